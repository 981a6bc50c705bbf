"""Step benchmark: every phase of a GRPO step next to what the raw engine does alone.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module scripts.bench_step   # CPU: the tiny demo model
    deepspeed --num_gpus 1 --module scripts.bench_step --model Qwen/Qwen2.5-0.5B-Instruct --template boxed \
        --dataset math500 --max-response-len 1024                 # a GPU machine
    python -m deepspeed.launcher.runner --num_gpus 8 --module scripts.bench_step --update-only --shape qwen2.5-7b
                                                                  # the update alone, no vLLM, no hub

On the same work, in one run:
  rollout   the trainer's rollout (train_grpo.generate, per-prompt seeded sampling) vs a bare
            vllm.LLM.generate of the same prompts with the same sampling parameters;
  update    the trainer's chunked log-probs + clipped surrogate + backward + step
            (train_grpo.update_minibatch) vs a bare DeepSpeed forward (full logits, cross
            entropy) + backward + step over the same micro-batches; plus the padding share;
  sync      seconds of sync_weights_to_vllm and its share of the step, and how it scales on
            random Qwen2 models of a few sizes;
  reward    responses/second of compute_rewards on 4096 math responses, and on code: HumanEval's
            canonical solutions (function tests) and LiveCodeBench's stdin problems (stdio);
  memory    peak memory of per-token log-probs + their gradient, chunked vs the naive full
            logits path, at vocabulary 151,936, hidden 896, 2 x 2048 tokens (own processes);
  peer      TRL's GRPOTrainer (HF generate, one process) on the same model, prompts, G, batch,
            lengths and micro-batch size: its seconds per step next to ours (rollout + reward +
            update + sync, warm); only where TRL is installed (pip install trl), not a dependency;
  gather    elements ZeRO-3 all-gathers for one micro-batch of chunked log-probs + backward
            (1000 response tokens, a random Qwen2 whose lm_head is ~half its parameters),
            with parameter release forced as when a model does not fit live (7B), per chunk
            size, in multiples of the parameter count.
Ratios are printed last; all numbers go to --out as JSON. This is a benchmark, not a test.

--update-only: the ZeRO-3 update alone (bf16 on CUDA, torch's fused AdamW, gradient checkpointing,
the trainer's update_minibatch) on a random-weight model of a real shape (SHAPES), with synthetic
responses: tokens/s, model TFLOP/s and MFU per device, the update's peak memory; then the
forward-only log-prob pass (fill_logprobs) at --micro-batch-size and at --logprob-batch-size:
seconds and what ZeRO-3 all-gathers, in multiples of the parameter count. Needs neither vLLM nor
a dataset; on the CPU, MFU needs --peak-tflops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import train_grpo
from data import loading
from grpo_utils import batching, distributed
from grpo_utils.common import is_hub_id
from grpo_utils.flags import check_finite, model_dir_problem
from grpo_utils.memory import memory_model, micro_batch_bytes, token_budget

ROOT = Path(__file__).resolve().parent.parent  # the project's root
_KEEP: list = []
TARGETS = {"rollout": 1.05, "update": 1.15, "sync_share": 0.05, "memory": 0.25, "gather_chunk64": 4.0}
# Real models' shapes (the architecture fields of their config.json) for --update-only, with random weights.
# Qwen2.5-Math-7B, the paper's policy, has Qwen2.5-7B's (it differs in context length and rope theta only).
SHAPES = {
    "tiny": dict(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=64, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-3b": dict(vocab_size=151_936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(vocab_size=152_064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}
# bytes per parameter a rank's ZeRO-3 states hold over the world, bf16 with fp32 accumulation: bf16 weights
# (2), fp32 master weights (4), Adam's two moments (8), fp32 gradient partition (4)
STATE_BYTES = 18
# ZeRO-3 settings under which every parameter is released after use and gathered again, as for a model larger
# than stage3_max_reuse_distance (a 7B): no reuse window, no live parameters kept, no prefetch, none persistent
RELEASE = {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 1000, "stage3_prefetch_bucket_size": 0,
           "stage3_param_persistence_threshold": 0}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--dataset", default="demo")
    p.add_argument("--data-dir", default=str(ROOT / "data" / "benchmarks"))
    p.add_argument("--template", default="plain")
    p.add_argument("--prompts-per-rank", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=None, help="default 64; --update-only: the trainer's, 4")
    p.add_argument("--max-prompt-len", type=int, default=64)
    p.add_argument("--max-response-len", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3, help="best of N for each timing")
    p.add_argument("--sync-hidden", default="256,512,1024", help="hidden sizes of the sync-scaling models")
    p.add_argument("--reward-n", type=int, default=4096)
    p.add_argument("--out", default="bench_step.json")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--memory-probe", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    p.add_argument("--peer-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer-steps", type=int, default=6, help="TRL steps timed (the first warms up)")
    p.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--logprob-chunk", type=int, default=train_grpo.parse_args([]).logprob_chunk,
                   help="the trainer's default")
    p.add_argument("--update-only", action="store_true", help="the ZeRO-3 update alone on a --shape (no vLLM)")
    p.add_argument("--lora-rank", type=int, default=0, help="--update-only: LoRA adapters of this rank, as the "
                   "trainer's --lora-rank (alpha 32), the base frozen; 0: full fine-tuning")
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES), help="--update-only: the model's shape")
    p.add_argument("--update-responses", type=int, default=32, help="--update-only: responses per rank per update")
    p.add_argument("--prompt-len", type=int, default=512, help="--update-only: prompt tokens of every response")
    p.add_argument("--response-len", type=int, default=1536,
                   help="--update-only: response tokens, drawn uniformly from [len/2, len]")
    p.add_argument("--logprob-batch-size", type=int, default=None,
                   help="--update-only: the forward-only batch (default: the trainer's, 4 x --micro-batch-size)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="--update-only: the trainer's token budget per micro-batch (default: the trainer's: on CUDA "
                        "sized from the free memory, on the CPU 0 = by --micro-batch-size)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="--update-only: recompute activations in backward (the trainer's default on CUDA)")
    p.add_argument("--force-release", action="store_true",
                   help="--update-only: ZeRO-3 releases every parameter after use, as it does for models above "
                        "stage3_max_reuse_distance (1e9 elements: 1.5B and up)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s for MFU (CUDA: default the table)")
    args = p.parse_args()
    sizes = ("micro_batch_size", "micro_batch_tokens", "logprob_batch_size")
    if args.update_only:  # the trainer's defaults outside the offline tasks, for this device
        given = [x for k in sizes if getattr(args, k) is not None for x in (f"--{k.replace('_', '-')}",
                                                                          str(getattr(args, k)))]
        trainer = train_grpo.parse_args(["--model", "Qwen/Qwen2.5-Math-7B", *given])
        for k in sizes:
            setattr(args, k, getattr(trainer, k))
    else:
        if args.micro_batch_tokens is not None:
            p.error("--micro-batch-tokens applies to --update-only (the step benchmark times --micro-batch-size)")
        if args.lora_rank:
            p.error("--lora-rank applies to --update-only (the step benchmark trains the whole model)")
        args.micro_batch_size, args.micro_batch_tokens = args.micro_batch_size or 64, 0
        if args.logprob_batch_size is None:
            args.logprob_batch_size = 4 * args.micro_batch_size
    try:
        check_args(args)
    except ValueError as e:
        p.error(str(e))
    # the trainer's flags that its functions read: its defaults (a flag a fork adds too), then the benchmark's
    for key, value in vars(train_grpo.parse_args([])).items():
        if not hasattr(args, key):
            setattr(args, key, value)
    args.agg, args.no_std_norm = "balanced", False  # the step measured: the paper's rule
    args.temperature, args.top_p = 1.0, 1.0
    args.policy_loss, args.clip_eps_low, args.clip_eps_high, args.kl_coef = "ppo", 0.2, 0.28, 0.0
    args.sapo_tau_pos, args.sapo_tau_neg = None, None
    args.rollout_correction, args.rollout_correction_cap = "none", 2.0
    args.prompts_per_step, args.minibatches, args.lr, args.weight_decay = 0, 1, 1e-6, 0.0
    args.lr_warmup_steps, args.ds_config, args.seed = 0, str(ROOT / "ds_config.json"), 0
    args.vllm_gpu_memory, args.reward_workers = 0.3, 4
    args.padded, args.deterministic = False, False  # packed rows (the padded ones: --update-only's second column)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Every setting that cannot run, in one line, before any engine, probe or timing starts."""
    for k in ("prompts_per_rank", "micro_batch_size", "max_prompt_len", "max_response_len", "repeats", "reward_n",
              "logprob_chunk", "logprob_batch_size"):
        if getattr(args, k) is not None and getattr(args, k) < 1:  # None: no cap but the token budget
            raise ValueError(f"--{k.replace('_', '-')} must be at least 1 (got {getattr(args, k)})")
    if (args.micro_batch_tokens or 0) < 0:
        raise ValueError(f"--micro-batch-tokens must be >= 0 (got {args.micro_batch_tokens})")
    if args.group_size < 2:
        raise ValueError(f"--group-size must be at least 2 (got {args.group_size}): advantages compare a group's "
                         "responses")
    if args.peer_steps < 2:
        raise ValueError(f"--peer-steps must be at least 2 (got {args.peer_steps}): the first one warms up")
    check_finite(args)
    if args.peak_tflops is not None and not 0 < args.peak_tflops <= 1e6:
        raise ValueError(f"--peak-tflops must be in (0, 1e6] (got {args.peak_tflops:g}): one device's peak TFLOP/s")
    for k in ("prompt_len", "response_len"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be at least 1 (got {getattr(args, k)})")
    check_lora_rank(args.lora_rank, SHAPES[args.shape]["hidden_size"], f"--shape {args.shape}")
    if args.update_responses < 8 or args.update_responses % 8:  # aggregation_weights over groups of 8
        raise ValueError(f"--update-responses must be a positive multiple of 8, the benchmark's group size (got "
                         f"{args.update_responses})")
    hidden = args.sync_hidden.split(",") if args.sync_hidden else []
    if not all(h.strip().isdigit() and int(h) > 0 and int(h) % 64 == 0 for h in hidden):
        raise ValueError(f"--sync-hidden {args.sync_hidden!r}: comma-separated multiples of 64 (the head size)")
    from data.demo import TASKS

    if args.model not in TASKS and not os.path.isdir(args.model) and not is_hub_id(args.model):
        raise ValueError(f"--model {args.model}: no such directory (need a checkpoint dir, a hub id, or demo / lab)")
    if args.model not in TASKS and os.path.isdir(args.model) and (problem := model_dir_problem(args.model)):
        raise ValueError(f"--model {args.model}: {problem}")
    from data.prepare import DATASETS

    if args.dataset not in (*TASKS, "demo-test", *DATASETS) and not os.path.exists(args.dataset) and \
            not is_hub_id(args.dataset):
        raise ValueError(f"--dataset {args.dataset}: not a file, a hub name, or one of demo, {', '.join(DATASETS)}")
    if os.path.isdir(args.dataset):
        raise ValueError(f"--dataset {args.dataset} is a directory; give a prepared .jsonl file or a name")
    check_out(args.out)


def check_lora_rank(rank: int, hidden: int, model: str) -> None:
    """A LoRA rank that PEFT takes and that adds something: B A of a linear layer has rank at most min(in, out),
    and every decoder layer has a side no wider than the hidden size."""
    if not 0 <= rank <= hidden:
        raise ValueError(f"--lora-rank must be in [0, {hidden}] (got {rank}): 0 is full fine-tuning, and a rank above "
                         f"the {model}'s hidden size {hidden} adds nothing")


def check_out(out: str) -> None:
    """The JSON results' file can be written, before the work whose numbers go there: tried, not read off
    permission bits (os.access passed /proc as root, and the write at the end failed after the whole benchmark);
    an existing file is opened for appending, which leaves it as it is."""
    from grpo_utils.common import first_line, writable_problem

    if Path(out).is_dir() or not Path(out).resolve().parent.is_dir():
        raise ValueError(f"--out {out}: must be a file in an existing directory (the JSON results)")
    if problem := writable_problem(Path(out).resolve().parent):
        raise ValueError(f"--out {out}: its directory is not writable ({problem})")
    if Path(out).exists():
        try:
            open(out, "a").close()
        except OSError as e:
            raise ValueError(f"--out {out}: not writable ({first_line(e)})") from None


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def best_of_pair(n: int, a, b) -> tuple[float, float]:
    """Best of n for two competitors timed alternately, so drift in machine load hits both."""
    ta, tb = [], []
    for _ in range(n):
        ta.append(best_of(1, a))
        tb.append(best_of(1, b))
    return min(ta), min(tb)


# -----------------------------------------------------------------------------
# log-prob memory, in a process of its own per path


def memory_probe(path: str, chunk: int) -> None:
    torch.manual_seed(0)
    vocab, hidden, tokens = 151_936, 896, 2 * 2048
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    lm_head = torch.nn.Linear(hidden, vocab, bias=False, device=dev)
    h = torch.randn(tokens, hidden, device=dev, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=dev)
    base = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if path == "chunked":
        logp = train_grpo.chunked_logprobs(lm_head, h, targets, 1.0, chunk)
    else:
        logp = torch.log_softmax(lm_head(h).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    logp.sum().backward()
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_bytes": peak - base, "logp": logp.detach()[:64].tolist(),
                      "grad": h.grad[:4, :16].flatten().tolist()}))


def logprob_memory(chunk: int) -> dict:
    out = {}
    for path in ("chunked", "naive"):  # a clean process each: peak RSS is per process
        env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
        res = subprocess.run([sys.executable, "-m", "scripts.bench_step", "--memory-probe", path,
                              "--logprob-chunk", str(chunk)], cwd=ROOT, capture_output=True, text=True, env=env)
        out[path] = json.loads(res.stdout.strip().splitlines()[-1])
    diff = max(abs(a - b) for a, b in zip(out["chunked"]["logp"] + out["chunked"]["grad"],
                                          out["naive"]["logp"] + out["naive"]["grad"]))
    chunked, naive = out["chunked"]["peak_bytes"], out["naive"]["peak_bytes"]
    return {"chunked_peak_gib": chunked / 2**30, "naive_peak_gib": naive / 2**30, "ratio": chunked / naive,
            "max_abs_diff": diff}


# -----------------------------------------------------------------------------
# The peer users would pick: TRL's GRPOTrainer on the same work (optional: pip install trl)


def peer_probe(args) -> None:
    """TRL's GRPOTrainer (HF generate, one process): seconds per step on the bench's model, prompts,
    G, batch, lengths, lr and micro-batch size; printed as JSON."""
    import tempfile

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from data.prepare import load_rows
    from data.templates import render_prompt
    from rewards import math_reward

    tok = AutoTokenizer.from_pretrained(args.model_path)
    rows = load_rows(args.dataset)[: args.prompts_per_rank * args.world]
    data = Dataset.from_list([{"prompt": render_prompt(r["prompt"], args.template, tok, r["kind"]),
                               "answer": r["answer"]} for r in rows])
    ends = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *a, **kw):
            ends.append(time.perf_counter())

    completions = len(rows) * args.group_size
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), num_generations=args.group_size, max_completion_length=args.max_response_len,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=max(1, completions // args.micro_batch_size), temperature=1.0, top_p=1.0,
        learning_rate=2e-4, beta=0.0, loss_type="dapo", max_steps=args.peer_steps, save_strategy="no",
        report_to="none", logging_steps=10**6, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(), seed=0)
    trainer = GRPOTrainer(model=args.model_path, args=cfg, train_dataset=data, processing_class=tok,
                          reward_funcs=lambda completions, answer, **kw: [math_reward(c, a)
                                                                          for c, a in zip(completions, answer)],
                          callbacks=[StepTimes()])
    start = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([start, *ends[:-1]], ends)][1:]  # the first step warms up
    print(json.dumps({"step_s": sorted(steps)[len(steps) // 2], "steps": len(steps)}))


def peer_row(args, our_step_s: float) -> dict | None:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "scripts.bench_step", "--peer-probe", "--model", args.model, "--dataset", args.dataset,
           "--template", args.template, "--prompts-per-rank", str(args.prompts_per_rank), "--group-size",
           str(args.group_size), "--micro-batch-size", str(args.micro_batch_size), "--max-response-len",
           str(args.max_response_len), "--world", str(args.world), "--peer-steps", str(args.peer_steps)]
    # one process on every core (this rank is pinned to its share)
    every_core = lambda: os.sched_setaffinity(0, range(os.cpu_count() or 1))  # noqa: E731
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                         preexec_fn=every_core if hasattr(os, "sched_setaffinity") else None)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"rc {res.returncode}"}
    trl = json.loads(res.stdout.strip().splitlines()[-1])
    import trl as trl_module

    return {"trl_version": trl_module.__version__, "trl_step_s": trl["step_s"], "ours_step_s": our_step_s,
            "speedup": trl["step_s"] / our_step_s}


# -----------------------------------------------------------------------------
# ZeRO-3 all-gather volume of the log-prob path


@contextlib.contextmanager
def count_gathers():
    """Yields a one-element list that counts the elements ZeRO-3 all-gathers inside the block."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm  # ZeRO-3 gathers through deepspeed.comm (both names are bound)

    gathered = [0]

    def counting(fn, out_name: str):  # the output is the first argument of both gathers
        def wrapped(*a, **kw):
            out = a[0] if a else kw[out_name]
            gathered[0] += sum(t.numel() for t in out) if isinstance(out, list) else out.numel()
            return fn(*a, **kw)
        return wrapped

    outputs = {"all_gather_into_tensor": "output_tensor", "all_gather": "tensor_list"}
    patched = [(mod, name, getattr(mod, name)) for mod in (deepspeed.comm, ds_comm) for name in outputs]
    for mod, name, fn in patched:
        setattr(mod, name, counting(fn, outputs[name]))
    try:
        yield gathered
    finally:
        for mod, name, fn in patched:
            setattr(mod, name, fn)


def gather_volume(chunks: list[int], world: int) -> dict:
    import deepspeed
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    out = {}
    for chunk in chunks:
        torch.manual_seed(0)
        ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4 * world,
              "zero_optimization": {"stage": 3, **RELEASE}, "zero_allow_untested_optimizer": True}
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = Qwen2ForCausalLM(cfg)
        params = sum(p.ds_numel for p in model.parameters())
        lm_head = model.lm_head.weight.ds_numel
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
        ids = torch.randint(0, cfg.vocab_size, (4, 260))
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[:, 10:] = True  # 4 x 250 = 1000 response tokens
        with count_gathers() as gathered:
            logp = train_grpo.token_logprobs(engine, ids, resp, {"attention_mask": torch.ones_like(ids)}, 1.0, chunk)
            engine.backward(logp.sum(), scale_wrt_gas=False)
        out[chunk] = {"gathered_x_params": gathered[0] / params, "lm_head_share": lm_head / params}
        engine.optimizer.zero_grad()
    return out


def bare_update(engine, batch: list[dict], micro: int, pad_id: int, device) -> None:
    """What DeepSpeed does alone: full-logits forward, cross entropy on the response, backward, step."""
    order = sorted(range(len(batch)), key=lambda i: len(batch[i]["tokens"]))
    for start in range(0, len(order), micro):
        mb = [batch[i] for i in order[start : start + micro]]
        ids, resp, inputs = batching.pad_batch([r["tokens"] for r in mb], [r["prompt_len"] for r in mb], pad_id, device)
        labels = torch.where(resp, ids, -100)
        loss = engine(input_ids=ids, **inputs, labels=labels, use_cache=False).loss
        engine.backward(loss)
        engine.step()


def padding_share(batch: list[dict], max_rows: int | None, max_tokens: int = 0, padded: bool = True) -> float:
    """The share of pad tokens in the update's micro-batches (batching.micro_batches; padded: rows x the longest each;
    packed rows carry none)."""
    if not padded:
        return 0.0
    lens = [len(r["tokens"]) for r in batch]
    parts = batching.micro_batches(lens, max_rows, max_tokens, packed=False)
    return 1 - sum(lens) / sum(len(b) * lens[b[-1]] for b in parts)


def time_sync(args, model_dir: Path, rank: int, local_rank: int, world: int) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if torch.cuda.is_available()
                                                 else torch.float32)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 partitions at load
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=train_grpo.deepspeed_config(args, world))
    llm = train_grpo.make_vllm(str(model_dir), args, rank, local_rank)
    secs = best_of(args.repeats, lambda: train_grpo.sync_weights_to_vllm(engine, llm))
    # Kept alive on purpose: a collected vLLM engine tears down torch.distributed's default group.
    _KEEP.append((engine, llm))
    return {"hidden": model.config.hidden_size, "params_m": params / 1e6, "sync_s": secs}


def sync_scaling(args, hidden_sizes: list[int], rank: int, local_rank: int, world: int) -> list[dict]:
    """Seconds to sync random Qwen2 models of a few sizes (ZeRO-3 gather + vLLM reload)."""
    import tempfile

    import torch.distributed as dist
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    rows = []
    tok = AutoTokenizer.from_pretrained(args.model_path)
    for h in hidden_sizes:
        d = Path(tempfile.gettempdir()) / f"bench-sync-{h}"
        if rank == 0 and not (d / "config.json").exists():
            cfg = Qwen2Config(vocab_size=len(tok), hidden_size=h, intermediate_size=4 * h, num_hidden_layers=4,
                              num_attention_heads=h // 64, num_key_value_heads=h // 64, head_dim=64,
                              max_position_embeddings=1024, tie_word_embeddings=False)
            Qwen2ForCausalLM(cfg).save_pretrained(d)
            tok.save_pretrained(d)
        dist.barrier()
        rows.append(time_sync(args, d, rank, local_rank, world))
    return rows


# -----------------------------------------------------------------------------
# --update-only: the ZeRO-3 update alone at a real model's shape


def synthetic_rollouts(n: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list[dict]:
    """n responses of random tokens (lengths uniform in [response_len/2, response_len]), advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, response_len // 2), response_len + 1, (n,), generator=g).tolist()
    return [{"tokens": torch.randint(0, vocab, (prompt_len + L,), generator=g).tolist(), "prompt_len": prompt_len,
             "length": L, "truncated": False, "old_logp": None, "vllm_logp": None, "advantage": float(2 * (i % 2) - 1)}
            for i, L in enumerate(lengths)]


def update_benchmark(args) -> None:
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541").items():
        os.environ.setdefault(k, v)
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config
    from transformers.integrations import HfDeepSpeedConfig

    cuda, world, local_rank = torch.cuda.is_available(), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    distributed.start_deepspeed_comm(cuda)
    if not cuda:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
        distributed.pin_cpu_rank(local_rank, local_world)
    rank, device = dist.get_rank(), torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    config = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=max(4096, args.prompt_len + args.response_len),
                         rope_theta=1e6, rms_norm_eps=1e-6)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if cuda:  # refuse, in one line, a shape whose states cannot fit rather than run out of memory minutes in
        # LoRA: the bf16 weights of every parameter, the other states of the adapters' alone
        trained = memory_model(config, True, 1, "flash", 1, lora_rank=args.lora_rank)["trained"]
        need = (n_params * 2 + (trained if args.lora_rank else n_params) * (STATE_BYTES - 2)) / world
        total = torch.cuda.get_device_properties(device).total_memory
        if need > 0.85 * total:
            per = f"{STATE_BYTES} bytes per parameter" if not args.lora_rank else \
                f"2 bytes per parameter, {STATE_BYTES - 2} per adapter parameter"
            if rank == 0:
                print(f"bench_step.py: error: {args.shape} ({n_params / 1e9:.2f}B parameters) holds "
                      f"{need / 2**30:.0f} GiB of ZeRO-3 states per GPU over {world} GPU(s) ({per}), "
                      f"{total / 2**30:.0f} GiB on this one: use more GPUs or a smaller --shape", flush=True)
            sys.exit(1)
    n = args.update_responses
    ds_args = argparse.Namespace(**{**vars(args), "prompts_per_step": n * world, "group_size": 1, "minibatches": 1})
    cfg = train_grpo.deepspeed_config(ds_args, world)
    if args.force_release:
        cfg["zero_optimization"].update(RELEASE)
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841  (from_config builds the model partitioned, under zero.Init)
    torch.manual_seed(0)
    args.padded, args.deterministic = False, False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32,
                                             attn_implementation=batching.attention_implementation(args))
    if args.lora_rank:  # as the trainer's build_trainer: adapters, then checkpointing
        model = train_grpo.with_adapters(model, args.lora_rank, 32.0)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.disable_input_require_grads()
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=cfg)
    engine.train()
    rollouts = synthetic_rollouts(n, args.prompt_len, args.response_len, config.vocab_size, 1000 + rank)
    lens = [len(r["tokens"]) for r in rollouts]
    args.pad_id = 0
    adv = torch.tensor([r["advantage"] for r in rollouts], dtype=torch.float64)
    lengths = torch.tensor([r["length"] for r in rollouts])
    w = train_grpo.aggregation_weights(adv, lengths, 8, args.agg)  # synthetic groups of 8
    model_flops, peak = train_grpo.model_flops_fn(engine, args.peak_tflops)
    peak = peak or (args.peak_tflops * 1e12 if args.peak_tflops else None)
    flops = model_flops(lens)
    budget_given = args.micro_batch_tokens

    def timed(fn) -> float:
        fn()  # warm-up: optimizer state, kernels, ZeRO-3's trace
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def run():
            fn()
            if cuda:
                torch.cuda.synchronize()
        return best_of(args.repeats, run)

    modes = {}
    for mode in ("packed", "padded"):  # the same engine, responses and budget rule; only the rows differ
        args.padded = mode == "padded"
        memory = train_grpo.trainer_memory(engine, args, max(lens), batching.attention_kind(args, cuda))
        held = torch.cuda.memory_allocated() if cuda else 0  # the ZeRO-3 states held now
        to_come = train_grpo.states_to_come(engine, memory)  # Adam's moments, before the first step (the first mode's)
        if budget_given is None:  # CUDA: as the trainer sizes it at its first update
            args.micro_batch_tokens = token_budget(memory, torch.cuda.mem_get_info()[0], max(lens), to_come)
        parts = train_grpo.rank_micro_batches(rollouts, args.micro_batch_size, args.micro_batch_tokens, not args.padded)
        t_update = timed(lambda: train_grpo.update_minibatch(engine, rollouts, w, args, args, device))
        largest = max(sum(lens[i] for i in b) if not args.padded else len(b) * lens[b[-1]] for b in parts)
        tot = distributed.all_reduce([sum(lens) / t_update, flops / t_update])
        slowest = distributed.all_reduce([t_update, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                                len(parts), (held + to_come + micro_batch_bytes(memory, largest)) / 2**30],
                               "max").tolist()
        modes[mode] = {"micro_batch_tokens": args.micro_batch_tokens, "micro_batches": int(slowest[2]),
                       "padding_share": padding_share(rollouts, args.micro_batch_size, args.micro_batch_tokens,
                                                      args.padded),
                       "update_s": slowest[0], "tokens_per_s": tot[0].item() / world,
                       "tflops": tot[1].item() / world / 1e12, "mfu": tot[1].item() / world / peak if peak else None,
                       "peak_gib": slowest[1] if cuda else None, "predicted_peak_gib": slowest[3] if cuda else None,
                       "model_mib_per_token": memory["per_token"] / 2**20, "model_fixed_gib": memory["fixed"] / 2**30}
    args.padded = False
    args.micro_batch_tokens = modes["packed"]["micro_batch_tokens"]
    # forward-only log-probs (fill_logprobs), at the update's micro-batch and at the forward-only batch (by
    # the token budget alone where there is one)
    forward = {}
    for batch in dict.fromkeys([args.micro_batch_size, args.logprob_batch_size]):
        fwd_args = argparse.Namespace(**{**vars(args), "logprob_batch_size": batch})
        fill = lambda a=fwd_args: train_grpo.fill_logprobs(engine, rollouts, "old_logp", a, a, device)  # noqa: E731
        seconds = timed(fill)
        with count_gathers() as gathered:
            fill()
        passes = len(train_grpo.rank_micro_batches(rollouts, batch, args.micro_batch_tokens, True))
        forward[batch or "budget"] = {"seconds": distributed.all_reduce([seconds]).item() / world, "passes": passes,
                                      "gathered_x_params": gathered[0] / n_params}
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "world": world, "shape": args.shape,
           "params_b": n_params / 1e9, "responses_per_rank": n, "micro_batch_size": args.micro_batch_size,
           "logprob_chunk": args.logprob_chunk, "gradient_checkpointing": args.gradient_checkpointing,
           "prompt_len": args.prompt_len, "response_len": args.response_len, "force_release": args.force_release,
           "peak_tflops": peak / 1e12 if peak else None, "lora_rank": args.lora_rank,
           "trained_params_m": sum(p.ds_numel for p in trained) / 1e6, **modes["packed"], "modes": modes,
           "forward_only": forward}
    if rank == 0:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"\nupdate benchmark ({res['device']}, {world} rank(s), {args.shape}: {res['params_b']:.2f}B parameters, "
              f"random weights, {f'LoRA rank {args.lora_rank}' if args.lora_rank else 'full fine-tuning'}: "
              f"{res['trained_params_m']:.1f}M parameters trained; ZeRO-3 {'bf16' if cuda else 'fp32'}, "
              "gradient checkpointing "
              f"{'on' if args.gradient_checkpointing else 'off'}, {n} responses of {args.prompt_len} + <= "
              f"{args.response_len} tokens per rank, micro-batches of "
              + (f"at most {args.micro_batch_size} responses" if args.micro_batch_size else "any number of responses")
              + f", log-prob chunk {args.logprob_chunk}); full numbers in {args.out}")
        cell = {"mfu": lambda v: f"{v:.3f}" if v is not None else "needs --peak-tflops",
                "peak_gib": lambda v: f"{v:.1f}" if v is not None else "CUDA only",
                "predicted_peak_gib": lambda v: f"{v:.1f}" if v is not None else "CUDA only",
                "micro_batch_tokens": lambda v: str(v or "any"), "micro_batches": str,
                "padding_share": lambda v: f"{v:.3f}", "tokens_per_s": lambda v: f"{v:.0f}",
                "tflops": lambda v: f"{v:.4g}", "update_s": lambda v: f"{v:.3f}"}
        print("| update, per device | packed | padded (--padded) |\n|---|---|---|")
        for k, show in cell.items():
            print(f"| {k.replace('_', ' ')} | {show(modes['packed'][k])} | {show(modes['padded'][k])} |")
        if peak:
            print(f"(MFU against a peak of {peak / 1e12:.3g} TFLOP/s)")
        print("| forward-only log-probs (fill_logprobs, packed) | seconds | passes | ZeRO-3 gathered, x params |\n"
              "|---|---|---|---|")
        for b, f in res["forward_only"].items():
            print(f"| batch {b} | {f['seconds']:.3f} | {f['passes']} | {f['gathered_x_params']:.2f} |")
    dist.barrier()


def main() -> None:
    args = parse_args()
    if args.memory_probe:
        return memory_probe(args.memory_probe, args.logprob_chunk)
    if args.peer_probe:
        from data.demo import model_dir

        args.model_path = model_dir(args.model)
        return peer_probe(args)
    if args.update_only:
        return update_benchmark(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # before vLLM starts: its NUMA memory binding is inherited by child processes and skews their RSS
    memory = logprob_memory(args.logprob_chunk) if os.environ.get("RANK", "0") == "0" else None
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541").items():
        os.environ.setdefault(k, v)
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import HfDeepSpeedConfig
    from vllm.inputs import TokensPrompt

    from rewards import compute_rewards, reference

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    distributed.start_deepspeed_comm(cuda)
    if not cuda:  # as the trainer does
        distributed.pin_cpu_rank(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    from data.demo import model_dir

    args.model_path = model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(args.model_path)
    args.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    args.prompts_per_step = args.prompts_per_rank * world
    rows_all, _ = loading.load_prompts(args.dataset, tok, args)
    rows = rows_all[rank * args.prompts_per_rank : (rank + 1) * args.prompts_per_rank]
    cfg = train_grpo.deepspeed_config(args, world)
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.bfloat16 if cuda else torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    llm = train_grpo.make_vllm(args.model_path, args, rank, local_rank)
    results = {"world": world, "device": "cuda" if cuda else "cpu", "model": args.model}

    # rollout: identical prompts and sampling parameters; first call of each warms up
    # the trainer's sampling parameters, with the sampled tokens' log-probs (T.rollout)
    params = train_grpo.sampling_params(args.group_size, 1.0, 1.0, args.max_response_len, 0, 1,
                                        range(rank * len(rows), (rank + 1) * len(rows)), logprobs=0)
    bare_prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in rows]
    outputs = None

    def trainer_rollout():
        nonlocal outputs
        outputs = train_grpo.generate(llm, rows, params)

    trainer_rollout()
    llm.generate(bare_prompts, params, use_tqdm=False)
    t_trainer, t_bare = best_of_pair(args.repeats, trainer_rollout,
                                     lambda: llm.generate(bare_prompts, params, use_tqdm=False))
    results["rollout"] = {"trainer_s": t_trainer, "bare_s": t_bare, "ratio": t_trainer / t_bare}

    # reward, then update on these rollouts
    rollouts = train_grpo.to_rollouts(rows, outputs)
    n = args.reward_workers  # every worker up, math-verify imported: one-offs, not a step's cost
    compute_rewards(["\\boxed{1/2}"] * n, ["0.5"] * n, ["math"] * n, n)
    t0 = time.perf_counter()
    scores = compute_rewards([r["text"] for r in rollouts], [reference(r["row"]) for r in rollouts],
                             [r["row"]["kind"] for r in rollouts], args.reward_workers)
    t_reward = time.perf_counter() - t0
    adv = train_grpo.advantages(torch.tensor(scores, dtype=torch.float64), args)
    adv = adv + 1e-3 * torch.randn(adv.shape, dtype=torch.float64)  # a gradient even if all groups agree
    for r, a in zip(rollouts, adv.tolist()):
        r["advantage"] = a
    lengths = torch.tensor([r["length"] for r in rollouts])
    w = train_grpo.aggregation_weights(adv, lengths, args.group_size, args.agg, max_len=args.max_response_len)
    engine.train()
    train_grpo.update_minibatch(engine, rollouts, w, args, args, device)  # warm-up: optimizer state, traces
    bare_update(engine, rollouts, args.micro_batch_size, args.pad_id, device)
    t_update, t_bare_update = best_of_pair(
        args.repeats, lambda: train_grpo.update_minibatch(engine, rollouts, w, args, args, device),
        lambda: bare_update(engine, rollouts, args.micro_batch_size, args.pad_id, device))
    # the trainer's perf/ metrics: model FLOPs (6 N per token + attention), MFU on CUDA
    model_flops, peak = train_grpo.model_flops_fn(engine, args.peak_tflops)
    flops = model_flops([len(r["tokens"]) for r in rollouts])
    n_tokens = sum(len(r["tokens"]) for r in rollouts)
    results["update"] = {"trainer_s": t_update, "bare_s": t_bare_update, "ratio": t_update / t_bare_update,
                         "padding_share": padding_share(rollouts, args.micro_batch_size, args.micro_batch_tokens,
                                                        args.padded),
                         "tflop_per_s": flops / t_update / 1e12, "mfu": flops / t_update / peak if peak else None,
                         "train_tokens_per_s": n_tokens / t_update,
                         "gen_tokens_per_s": sum(r["length"] for r in rollouts) / t_trainer}

    t_sync = best_of(args.repeats, lambda: train_grpo.sync_weights_to_vllm(engine, llm))
    step = t_trainer + t_reward + t_update + t_sync
    results["sync"] = {"sync_s": t_sync, "step_s": step, "share": t_sync / step}
    results["gather"] = gather_volume([64, 256, 1024], world)
    results["sync_scaling"] = sync_scaling(args, [int(x) for x in args.sync_hidden.split(",") if x], rank,
                                           local_rank, world)

    args.world = world
    results["peer"] = peer_row(args, step) if rank == 0 else None

    if rank == 0:
        from data.reward_cases import cases  # real MATH-500 solutions, half scored against a wrong answer

        cs = cases("math500") if (Path(args.data_dir) / "math500.jsonl").exists() else None
        if cs:
            resp = [cs[i % len(cs)]["response"] for i in range(args.reward_n)]
            ans = [cs[(i + (i // len(cs)) % 2) % len(cs)]["answer"] for i in range(args.reward_n)]
            compute_rewards(resp[:16], ans[:16], ["math"] * 16, args.reward_workers)  # workers up
            t0 = time.perf_counter()
            compute_rewards(resp, ans, ["math"] * args.reward_n, args.reward_workers)
            results["reward"] = {"responses": args.reward_n, "workers": args.reward_workers,
                                 "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else torch.get_num_threads(),
                                 "per_s": args.reward_n / (time.perf_counter() - t0)}
        results["reward_code"] = code_reward_rates(args.reward_workers) if shutil.which("bwrap") else None
        results["logprob_memory"] = memory
        Path(args.out).write_text(json.dumps(results, indent=1))
        r = results
        print(f"\nstep benchmark ({r['device']}, {world} ranks, model {args.model}); full numbers in {args.out}")
        print("| phase | trainer | raw engine | ratio | target |\n|---|---|---|---|---|")
        print(f"| rollout | {r['rollout']['trainer_s']:.3f} s | {r['rollout']['bare_s']:.3f} s | "
              f"{r['rollout']['ratio']:.3f} | <= {TARGETS['rollout']} |")
        print(f"| update | {r['update']['trainer_s']:.3f} s | {r['update']['bare_s']:.3f} s | "
              f"{r['update']['ratio']:.3f} | <= {TARGETS['update']} "
              f"(padding share {r['update']['padding_share']:.3f}) |")
        u = r["update"]
        mfu = f"MFU {u['mfu']:.3f}" if u["mfu"] is not None else "MFU: CUDA only"
        print(f"| throughput per rank | generated {u['gen_tokens_per_s']:.0f} tok/s, trained "
              f"{u['train_tokens_per_s']:.0f} tok/s, {u['tflop_per_s'] * 1e3:.1f} GFLOP/s | | | {mfu} |")
        print(f"| weight sync | {r['sync']['sync_s']:.3f} s | step {r['sync']['step_s']:.3f} s | "
              f"{r['sync']['share']:.3f} of step | <= {TARGETS['sync_share']} |")
        for s in r["sync_scaling"]:
            print(f"| sync, {s['params_m']:.0f}M params | {s['sync_s']:.3f} s | | | |")
        if "reward" in r:
            print(f"| reward | {r['reward']['per_s']:.0f} responses/s ({r['reward']['workers']} workers, "
                  f"{r['reward']['cores']} core{'s' * (r['reward']['cores'] != 1)}) | | | "
                  "MATH-500 solutions, half vs a wrong answer |")
        for kind, per_s in (r.get("reward_code") or {}).items():
            print(f"| reward, code | {per_s:.0f} responses/s ({args.reward_workers} workers) | | | "
                  f"{kind}, all passing |")
        if r["peer"] is None:
            print("| peer: TRL GRPOTrainer | not installed (pip install trl) | | | |")
        elif "error" in r["peer"]:
            print(f"| peer: TRL GRPOTrainer | failed: {r['peer']['error']} | | | |")
        else:
            pr = r["peer"]
            print(f"| step vs TRL {pr['trl_version']} GRPOTrainer | {pr['ours_step_s']:.3f} s | "
                  f"TRL {pr['trl_step_s']:.3f} s | {pr['speedup']:.2f} x TRL's speed | >= 1.5 |")
        for chunk, g in r["gather"].items():
            target = f"<= {TARGETS['gather_chunk64']}" if chunk == 64 else ""
            print(f"| ZeRO-3 gather, chunk {chunk} | {g['gathered_x_params']:.2f} x params per micro-batch | | | "
                  f"{target} (lm_head {g['lm_head_share']:.2f} of params, release forced) |")
        m = r["logprob_memory"]
        print(f"| log-prob memory | {m['chunked_peak_gib']:.2f} GiB | naive {m['naive_peak_gib']:.2f} GiB | "
              f"{m['ratio']:.3f} | <= {TARGETS['memory']} (max diff {m['max_abs_diff']:.1e}) |")
    dist.barrier()


def code_reward_rates(workers: int) -> dict[str, float]:
    """Responses/second of compute_rewards on code that passes, each set after its workers are up."""
    from data.reward_cases import code_cases
    from rewards import compute_rewards

    rates = {}
    for kind in ("humaneval", "livecodebench_stdin"):
        responses, tests = code_cases(kind)
        compute_rewards(responses[:workers], tests[:workers], ["code"] * workers, workers)
        t0 = time.perf_counter()
        compute_rewards(responses, tests, ["code"] * len(responses), workers)
        rates[kind] = len(responses) / (time.perf_counter() - t0)
    return rates


if __name__ == "__main__":
    main()
    distributed.exit_without_teardown()  # every file is written and every rank past its last barrier (gloo can abort)
