"""GRPO with seq / token / balanced loss aggregation, on vLLM + DeepSpeed ZeRO-3.

    deepspeed train_grpo.py --agg balanced --model Qwen/Qwen2.5-Math-7B \
        --dataset BytedTsinghua-SIA/DAPO-Math-17k --template dapo
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 train_grpo.py     # the offline demo

One step, top to bottom:
  1. rollout     every rank samples G responses for its share of the prompts with its own
                 colocated, in-process vLLM engine;
  2. reward      rule-based, verifiable (rewards.py);
  3. advantage   A_i = (r_i - mean_g) / (std_g + eps) within each group of G;
  4. aggregate   one weight w_i per response so that loss = sum_i w_i sum_t l_it over the
                 global batch (the three rules of the paper, `aggregation_weights`);
  5. update      PPO-clip surrogate per token, ZeRO-3 backward/step per mini-batch;
  6. sync        gather ZeRO-3 partitions one parameter at a time into vLLM, in place.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
import warnings
import zipfile
from collections import defaultdict
from pathlib import Path

# Engines run in this process (colocated), as RL trainers use them; must precede `import vllm`.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("DS_ACCELERATOR") == "cpu":
    # vLLM's CPU build warns about every missing GPU-side optimisation (Triton, tcmalloc, NUMA
    # binding): only errors, on the CPU; on GPUs its warnings are worth reading.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch is imported
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)  # logs before vLLM's logging is set up
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op. is deprecated")

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from data.prepare import first_line  # noqa: E402  (an error's first non-empty line, for one-line messages)

# -----------------------------------------------------------------------------
# Hyperparameters. Defaults follow the DAPO recipe (clip-higher 0.2/0.28, lr 1e-6 with
# 10 warm-up steps, no KL, 16 responses per prompt, 512 prompts per step in 16
# mini-batches). `--model demo` switches to DEMO_DEFAULTS unless a flag is given.

DEMO_DEFAULTS = dict(
    dataset="demo", eval_dataset="demo-test", template="plain", lr=2e-4, lr_warmup_steps=0,
    weight_decay=0.0, group_size=8, prompts_per_step=32, minibatches=1, micro_batch_size=64,
    max_prompt_len=32, max_response_len=12, steps=40, eval_interval=10, save_interval=20,
    eval_samples=4, eval_limit=200, output_dir="runs/demo",
)
# The aggregation lab (data/demo.py): the same task, with responses of 5-35 tokens whose failures
# ramble longer; output in runs/lab-AGG (or runs/lab-nogap-AGG), a checkpoint every 10 steps.
LAB_DEFAULTS = {**DEMO_DEFAULTS, "max_response_len": 48, "save_interval": 10, "output_dir": None}
OFFLINE_DEFAULTS = {"demo": DEMO_DEFAULTS, "lab": LAB_DEFAULTS, "lab-nogap": LAB_DEFAULTS, "lab-nogap-hi": LAB_DEFAULTS}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="demo", help="HF model id or local dir; 'demo', 'lab', 'lab-nogap(-hi)': offline policies")
    a("--dataset", default="BytedTsinghua-SIA/DAPO-Math-17k", help="prepared .jsonl/.parquet, HF name, or 'demo'")
    a("--eval-dataset", default=None, help="held-out prompts scored every --eval-interval steps")
    a("--template", default="dapo", choices=["plain", "chat", "boxed", "dapo"])
    a("--agg", default="balanced", choices=["seq", "token", "balanced", "balanced-batch"],
      help="loss aggregation rule (balanced-batch: this project's variant, README)")
    a("--group-size", type=int, default=16, help="G: responses sampled per prompt")
    a("--prompts-per-step", type=int, default=512, help="prompts per rollout batch, over all ranks")
    a("--minibatches", type=int, default=16, help="optimizer updates per rollout batch")
    a("--micro-batch-size", type=int, default=4, help="responses per forward/backward per rank")
    a("--lr", type=float, default=1e-6)
    a("--lr-warmup-steps", type=int, default=10, help="rollout steps of linear warm-up")
    a("--weight-decay", type=float, default=0.1)
    a("--clip-eps-low", type=float, default=0.2)
    a("--clip-eps-high", type=float, default=0.28)
    a("--kl-coef", type=float, default=0.0, help="k3 KL to a frozen reference; 0 = no reference model")
    a("--no-std-norm", action="store_true", help="A = r - mean (Dr. GRPO): do not divide by the group std")
    a("--max-prompt-len", type=int, default=1024, help="longer prompts are dropped (counted)")
    a("--max-response-len", type=int, default=3072)
    a("--temperature", type=float, default=1.0)
    a("--top-p", type=float, default=1.0)
    a("--steps", type=int, default=500)
    a("--eval-interval", type=int, default=25)
    a("--eval-samples", type=int, default=8, help="k of the sampled Acc@k at evaluation")
    a("--eval-limit", type=int, default=512, help="at most this many held-out prompts")
    a("--save-interval", type=int, default=50, help="steps between checkpoints (full state + HF export)")
    a("--keep-last", type=int, default=3, help="full training states kept (HF exports are all kept)")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    a("--max-bad-steps", type=int, default=5, help="consecutive non-finite steps before the run stops")
    a("--mask-truncated", action="store_true", help="no loss on responses cut at --max-response-len (DAPO)")
    a("--output-dir", default=None, help="default runs/<model>-<agg>")
    a("--seed", type=int, default=42)
    a("--ds-config", default=str(ROOT / "ds_config.json"))
    a("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
      help="recompute activations in backward (default: on with CUDA, where 7B activations do not fit without it)")
    a("--logprob-chunk", type=int, default=256, help="tokens per lm_head chunk in log-prob computation")
    a("--vllm-gpu-memory", type=float, default=0.5, help="CUDA only: vLLM's share of GPU memory")
    a("--reward-workers", type=int, default=4)
    a("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    pre, _ = p.parse_known_args(argv)
    if pre.model in OFFLINE_DEFAULTS:
        p.set_defaults(**OFFLINE_DEFAULTS[pre.model])
    args = p.parse_args(argv)
    if args.output_dir is None:
        args.output_dir = f"runs/{Path(args.model).name}-{args.agg}"
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Fail in one line, with the rule, before any expensive work, on settings that cannot run."""
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    at_least_1 = ["minibatches", "micro_batch_size", "steps", "max_prompt_len", "max_response_len", "logprob_chunk",
                  "eval_interval", "eval_samples", "eval_limit", "save_interval", "max_bad_steps", "reward_workers"]
    for k in at_least_1:
        if getattr(args, k) < 1:
            raise ValueError(f"{flag(k)} must be at least 1 (got {getattr(args, k)})")
    for k in ["lr_warmup_steps", "weight_decay", "kl_coef", "keep_last", "clip_eps_high"]:
        if getattr(args, k) < 0:
            raise ValueError(f"{flag(k)} must be >= 0 (got {getattr(args, k)})")
    ranges = {"lr": (args.lr > 0, "> 0"), "temperature": (args.temperature > 0, "> 0 (sampled groups)"),
              "top_p": (0 < args.top_p <= 1, "in (0, 1]"), "clip_eps_low": (0 <= args.clip_eps_low < 1, "in [0, 1)"),
              "vllm_gpu_memory": (0 < args.vllm_gpu_memory < 1, "in (0, 1)")}
    for k, (ok, rule) in ranges.items():
        if not ok:
            raise ValueError(f"{flag(k)} must be {rule} (got {getattr(args, k)})")
    if args.group_size < 2:
        raise ValueError("--group-size must be at least 2: group advantages compare a response with its siblings")
    if args.prompts_per_step < world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} is smaller than the {world} ranks")
    if args.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the {world} ranks")
    per_rank = args.prompts_per_step // world
    if per_rank % args.minibatches:
        raise ValueError(
            f"each rank's {per_rank} prompts per step do not split into --minibatches {args.minibatches}"
        )
    if not args.model.strip():
        raise ValueError("--model is empty (need a checkpoint dir, a hub id, or demo / lab / lab-nogap)")
    if args.model not in OFFLINE_DEFAULTS and not os.path.isdir(args.model) and (
        args.model.startswith((".", "/", "~")) or args.model.count("/") != 1
    ):
        raise ValueError(f"--model {args.model}: no such directory (need a checkpoint dir or a hub id)")
    accelerator = os.environ.get("DS_ACCELERATOR")
    if accelerator is not None and accelerator not in ("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu"):
        raise ValueError(f"DS_ACCELERATOR={accelerator} is not an accelerator DeepSpeed knows (cpu, cuda, ...)")


# -----------------------------------------------------------------------------
# GRPO: advantages and the three aggregation rules


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over each group of `group_size` consecutive responses."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def aggregation_weights(
    advantages: torch.Tensor, lengths: torch.Tensor, group_size: int, agg: str,
    batch_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weights w_i with loss = sum_i w_i sum_t l_it; per group, then averaged over groups.

    seq:      (1/G) sum_i (1/L_i) sum_t l_it                 -> w_i = 1 / (G L_i)
    token:    sum_i sum_t l_it / sum_i L_i                   -> w_i = 1 / sum_g L
    balanced: sum_{S in P,N,Z nonempty} (|S|/G) sum_{i in S} sum_t l_it / sum_{i in S} L_i
              with P: A>0, N: A<0, Z: A=0                    -> w_i = |S_i| / (G sum_{S_i} L)
    balanced-batch (this project's variant, not the paper's): balanced with each subset's mean
              length taken over the whole batch, Lbar_S = mean of L over the batch's responses
              of S's sign (`batch_lengths`: sign_lengths summed over ranks; default: these
              responses)                                     -> w_i = 1 / (G Lbar_{S_i})
              A subset's weight is |S|/G only in expectation, not in every group.
    """
    A = advantages.view(-1, group_size)
    L = lengths.view(-1, group_size).to(torch.float64).clamp(min=1)  # an empty response has no terms anyway
    if agg == "seq":
        w = 1.0 / (group_size * L)
    elif agg == "token":
        w = (1.0 / L.sum(dim=1, keepdim=True)).expand_as(L)
    elif agg == "balanced":
        w = torch.zeros_like(L)
        for subset in (A > 0, A < 0, A == 0):
            count = subset.sum(dim=1, keepdim=True)
            tokens = (L * subset).sum(dim=1, keepdim=True).clamp(min=1)
            w = torch.where(subset, count / (group_size * tokens), w)
    elif agg == "balanced-batch":
        sums = sign_lengths(advantages, lengths) if batch_lengths is None else batch_lengths
        mean = sums[:, 0] / sums[:, 1].clamp(min=1)
        w = torch.zeros_like(L)
        for subset, mean_len in zip((A > 0, A < 0, A == 0), mean.clamp(min=1).tolist()):
            w = torch.where(subset, 1.0 / (group_size * mean_len), w)
    else:
        raise ValueError(f"unknown aggregation {agg!r}")
    return (w / A.shape[0]).view(-1)  # mean over the groups of the batch


def sign_lengths(advantages: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[[tokens, responses]] of the A>0, A<0 and A=0 responses; masked (L=0) responses not counted."""
    L, kept = lengths.to(torch.float64), lengths > 0
    return torch.tensor([[L[s & kept].sum().item(), (s & kept).sum().item()]
                         for s in (advantages > 0, advantages < 0, advantages == 0)], dtype=torch.float64)


def policy_loss_per_token(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
    ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate with clip-higher: l = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A) [+ beta k3]."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    loss = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    stats = {
        "clipped": ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0)),
        "approx_kl": (ratio - 1) - log_ratio,  # k3 estimate of KL(old || new)
    }
    if ref_logp is not None:
        ref_kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3 of KL(pi || ref)
        loss = loss + kl_coef * ref_kl
        stats["ref_kl"] = ref_kl
    return loss, stats


# -----------------------------------------------------------------------------
# Per-token log-probs without a [tokens x vocab] float32 logits tensor


def _chunk_logprobs(weight: torch.Tensor, bias, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)


def token_logprobs(
    engine, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    response_mask: torch.Tensor, temperature: float, chunk: int,
) -> torch.Tensor:
    """log pi(y_t | y_<t) for the response tokens (response_mask), flattened in row order."""
    # The forward goes through the DeepSpeed engine, and the loss is built from its output: the
    # final (normed) hidden states, hidden_states[-1], with logits_to_keep=[] so that the model's
    # own lm_head runs on an empty slice (ZeRO-3 still gathers lm_head for that call; the logits
    # are computed in chunks below). DeepSpeed hooks that output, so its backward prologue runs
    # (ZeRO-3 gradient-accumulation bookkeeping, the accumulation-boundary flag offload reads).
    out = engine(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True,
                 logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device))
    predict = response_mask[:, 1:]  # position t predicts token t+1
    hidden = out.hidden_states[-1][:, :-1][predict]
    return chunked_logprobs(engine.module.lm_head, hidden, input_ids[:, 1:][predict], temperature, chunk)


def chunked_logprobs(
    lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int
) -> torch.Tensor:
    """log softmax(lm_head(h) / T)[target] for [N, H] hidden states, `chunk` rows at a time.

    With gradients on, each chunk is recomputed in backward (checkpointed), so peak memory
    holds one chunk's [chunk x vocab] float32 logits instead of all of them. All chunks run
    inside a single call of the lm_head module, so ZeRO-3 gathers its weight once for the
    forward and once for the backward, however many chunks there are (and every rank makes
    the same one call per micro-batch, whatever its token count).
    """
    def by_chunks(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = []
        for h_c, t_c in zip(h.split(chunk), t.split(chunk)):
            args = (lm_head.weight, lm_head.bias, h_c, t_c, temperature)
            if torch.is_grad_enabled():
                out.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False))
            else:
                out.append(_chunk_logprobs(*args))
        return torch.cat(out) if out else hidden.new_zeros(0)

    # the module's own hooks (ZeRO-3's gather and release) wrap this call; forward is swapped for it
    own = lm_head.__dict__.get("forward")
    lm_head.forward = by_chunks
    try:
        return lm_head(hidden, targets)
    finally:
        if own is None:
            del lm_head.forward
        else:
            lm_head.forward = own


def pad_batch(seqs: list[list[int]], prompt_lens: list[int], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Right-padded input_ids, attention_mask and response_mask for sequences prompt+response."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    resp = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        resp[i, p : len(s)] = True
    return ids.to(device), attn.to(device), resp.to(device)


# -----------------------------------------------------------------------------
# The ZeRO-3 update on one mini-batch


def update_minibatch(engine, batch: list[dict], weights: torch.Tensor, args, world: int, device) -> dict[str, float]:
    """Accumulate d/dtheta of sum_i w_i sum_t l_it over this rank's share of a mini-batch, then step.

    `weights` already carry the global normalisation, so the rank-local losses sum to the
    global loss. DeepSpeed averages gradients over ranks, hence the factor `world`, and
    `scale_wrt_gas=False` stops it from also dividing by the accumulation steps: the
    gradient is then the same for any number of ranks and any micro-batch size.
    """
    sums = defaultdict(float)
    order = sorted(range(len(batch)), key=lambda i: len(batch[i]["tokens"]))  # bucket by length
    for start in range(0, len(order), args.micro_batch_size):
        idx = order[start : start + args.micro_batch_size]
        mb = [batch[i] for i in idx]
        ids, attn, resp = pad_batch([r["tokens"] for r in mb], [r["prompt_len"] for r in mb], args.pad_id, device)
        logp = token_logprobs(engine, ids, attn, resp, args.temperature, args.logprob_chunk)
        n_tok = torch.tensor([r["length"] for r in mb], device=device)
        per_token = lambda x: torch.repeat_interleave(x.to(device), n_tok)  # noqa: E731
        old = torch.cat([r["old_logp"] for r in mb]).to(device) if mb[0]["old_logp"] is not None else logp.detach()
        ref = torch.cat([r["ref_logp"] for r in mb]).to(device) if args.kl_coef > 0 else None
        adv = per_token(torch.tensor([r["advantage"] for r in mb], dtype=logp.dtype))
        w = per_token(weights[idx].to(logp.dtype))
        loss_t, st = policy_loss_per_token(logp, old, adv, args.clip_eps_low, args.clip_eps_high, ref, args.kl_coef)
        loss = (w * loss_t).sum()
        engine.backward(loss * world, scale_wrt_gas=False)
        engine.step()
        sums["pg_loss"] += loss.item()
        sums["tokens"] += logp.numel()
        for k, v in st.items():
            sums[k] += v.float().sum().item()
    sums["grad_norm"] = float(engine.get_global_grad_norm() or 0.0)
    return sums


@torch.no_grad()
def fill_logprobs(engine, rollouts: list[dict], key: str, args, device) -> None:
    for start in range(0, len(rollouts), args.micro_batch_size):
        mb = rollouts[start : start + args.micro_batch_size]
        ids, attn, resp = pad_batch([r["tokens"] for r in mb], [r["prompt_len"] for r in mb], args.pad_id, device)
        lp = token_logprobs(engine, ids, attn, resp, args.temperature, args.logprob_chunk).float().cpu()
        for r, x in zip(mb, lp.split([r["length"] for r in mb])):
            r[key] = x


# -----------------------------------------------------------------------------
# Collectives. NCCL serves CUDA tensors only ("No backend type associated with device type
# cpu"), gloo CPU tensors: every collective of the project goes through these two functions,
# which put the data on the device the backend serves (tests/test_collectives.py enforces it).


def collective_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else torch.device("cpu")


def all_reduce(values, op: str = "sum") -> torch.Tensor:
    """A vector of numbers summed ("sum") or maximised ("max") over ranks; float64, on the CPU."""
    import torch.distributed as dist

    t = torch.as_tensor(values, dtype=torch.float64).to(collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.cpu()


def all_gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (NCCL: pickled through the current CUDA device)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# -----------------------------------------------------------------------------
# vLLM: rollout engine and weight sync


def make_vllm(model_path: str, args, rank: int, local_rank: int):
    from transformers import AutoConfig
    from vllm import LLM

    # Expected at every sync, not a failure: rotary embeddings have no weights, and a tied
    # lm_head receives its weights through embed_tokens. An untied lm_head that fails to load
    # is a real failure and stays visible.
    expected = {"RotaryEmbedding: Failed to load weights"}
    if getattr(AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False):
        expected.add("ParallelLMHead: Failed to load weights")
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: record.getMessage() not in expected)

    max_len = args.max_prompt_len + args.max_response_len
    cuda = torch.cuda.is_available()
    kw = dict(gpu_memory_utilization=args.vllm_gpu_memory, enable_sleep_mode=True, dtype="bfloat16") if cuda \
        else vllm_cpu_kwargs(max_len)
    # external_launcher: one engine per launched rank, on the device of LOCAL_RANK, inside the
    # launcher's process group (CPU and CUDA alike). vLLM's default uniprocess executor would put
    # every rank's engine on cuda:0 and move the rank's current device there.
    llm = LLM(model=model_path, max_model_len=max_len, seed=args.seed + rank, tensor_parallel_size=1,
              distributed_executor_backend="external_launcher", use_tqdm_on_load=False, **kw)
    moved = cuda and torch.cuda.current_device() != local_rank
    errors = [e for e in all_gather_objects(
        f"rank {rank}: vLLM's engine moved the current CUDA device to cuda:{torch.cuda.current_device()}, "
        f"not cuda:{local_rank} (LOCAL_RANK)" if moved else None) if e]
    if errors:  # every rank stops, not just the one that moved
        sys.exit(f"train_grpo.py: error: {errors[0]}")
    return llm


def pin_cpu_rank(local_rank: int, local_world: int) -> None:
    """On the CPU, each rank (its trainer and its in-process vLLM engine) on its own share of cores.

    vLLM binds threads only for engines in worker processes (VLLM_CPU_OMP_THREADS_BIND does
    nothing in-process); unpinned, every rank runs one thread per core of the machine, and the
    ranks' spinning OpenMP threads fight over the cores (measured on 2 cores, 2 ranks: the same
    rollout 2.5-4 x slower than one rank alone).
    A launcher that binds ranks itself (deepspeed --bind_cores_to_rank) sets OMP_NUM_THREADS:
    then it is left alone. Call it before the first parallel torch op, so that every thread
    this rank starts from then on inherits its cores.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    if not hasattr(os, "sched_setaffinity"):  # macOS: no affinity, threads only
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        return
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // local_world)
    mine = [cores[(local_rank * per + i) % len(cores)] for i in range(per)]  # more ranks than cores: shared
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))


def vllm_cpu_kwargs(max_model_len: int) -> dict:
    # vLLM's CPU sampler cannot rewind a seeded request's generator when chunked prefill splits
    # its prompt ("CPU Generator does not use offset"), which happens as soon as a batch's prompt
    # tokens exceed the token budget. Prefill whole prompts instead, with a budget that holds
    # the longest (vLLM's CPU platform does the same for MLA models).
    return dict(dtype="float32", enforce_eager=True, enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_model_len, 4096))


def sync_weights_to_vllm(engine, llm) -> None:
    """Stream the trainer's weights into vLLM in place, one gathered ZeRO-3 parameter at a time.

    Each parameter is all-gathered (a collective: every rank walks the same order), handed
    to vLLM's loader under its Hugging Face name and released before the next one, so no
    rank ever holds a second full copy of the model.
    """
    import deepspeed

    def weights():
        for name, param in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                yield name, param.data

    load_weights_into_vllm(llm, weights_iterator=weights())


def load_weights_into_vllm(llm, weights_iterator=None, weights_path: str | None = None) -> None:
    """vLLM's in-place reload, from (HF name, tensor) pairs or from a checkpoint directory."""
    kwargs = {"weights_iterator": weights_iterator} if weights_iterator is not None else {"weights_path": weights_path}
    llm.collective_rpc("reload_weights", kwargs=kwargs)
    if not torch.cuda.is_available():
        llm.apply_model(_repack_cpu_lm_head)
    llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights


def _repack_cpu_lm_head(model: torch.nn.Module) -> None:
    # vLLM's CPU backend pre-packs every GEMM weight, lm_head's too. With tied embeddings the
    # reload only touches embed_tokens, leaving lm_head's packed copy stale: repack it.
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and hasattr(lm_head, "quant_method"):
        lm_head.quant_method.process_weights_after_loading(lm_head)


def sampling_seed(seed: int, step: int, prompt_index: int, group_size: int) -> int:
    # vLLM gives the j-th of n samples seed+j, so per-prompt seeds are spaced by G.
    return ((seed * 100_003 + step) * 1_000_003 + prompt_index) * group_size % (2**31 - group_size)


# -----------------------------------------------------------------------------
# Data, evaluation, checkpoints, logging


def load_prompts(
    spec: str, tokenizer, args, limit: int | None = None, train: bool = False
) -> tuple[list[dict], int]:
    """Rows with their rendered, tokenized prompt; drops (and counts) over-long prompts.
    train: a training set, deduplicated by prompt (held-out sets are taken as published)."""
    from data.prepare import load_rows
    from data.templates import render_prompt

    rows, dropped = [], 0
    for row in load_rows(spec, train=train):
        text = render_prompt(row["prompt"], args.template, tokenizer, row["kind"])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > args.max_prompt_len:
            dropped += 1
            continue
        rows.append({**row, "prompt_ids": ids})
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"dataset {spec}: no prompts left ({dropped} longer than --max-prompt-len)")
    return rows, dropped


def reference(row: dict):
    """What a response is scored against: the answer (math) or the tests (code)."""
    return row["answer"] if row["kind"] == "math" else row["tests"]


def generate(llm, rows: list[dict], params: list) -> list:
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in rows], params, use_tqdm=False)


def to_rollouts(rows: list[dict], outputs: list) -> list[dict]:
    """One record per sampled response, G consecutive per prompt; vLLM's token ids as returned."""
    return [
        {"row": row, "text": c.text, "prompt_len": len(row["prompt_ids"]),
         "tokens": row["prompt_ids"] + list(c.token_ids), "length": len(c.token_ids),
         "truncated": c.finish_reason == "length", "old_logp": None}
        for row, o in zip(rows, outputs) for c in o.outputs
    ]


def evaluate(llm, rows: list[dict], args, rank: int, world: int, step: int, out_dir: Path) -> dict[str, float]:
    """Greedy accuracy and sampled Acc@k on this rank's shard of the held-out prompts."""
    from vllm import SamplingParams

    from rewards import compute_rewards

    shard = rows[rank::world]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_response_len)
    g_out = generate(llm, shard, [greedy] * len(shard))
    s_out = generate(llm, shard, eval_sampling_params(args, step, range(rank, len(rows), world)))
    g_text = [o.outputs[0].text for o in g_out]
    s_text = [c.text for o in s_out for c in o.outputs]
    g_score = compute_rewards(g_text, [reference(r) for r in shard], [r["kind"] for r in shard], args.reward_workers)
    k = args.eval_samples
    s_score = compute_rewards(s_text, [reference(r) for r in shard for _ in range(k)],
                              [r["kind"] for r in shard for _ in range(k)], args.reward_workers)
    t = all_reduce([sum(g_score), sum(s_score), len(shard), len(s_score)])
    samples = [{"id": r["id"], "answer": r.get("answer"), "greedy": txt, "score": s}
               for r, txt, s in zip(shard, g_text, g_score)]
    gathered = all_gather_objects(samples)
    if rank == 0:
        (out_dir / "eval").mkdir(parents=True, exist_ok=True)
        with open(out_dir / "eval" / f"step_{step:06d}.jsonl", "w") as f:
            for part in gathered:
                for s in part:
                    f.write(json.dumps(s) + "\n")
    return {"eval/acc_greedy": (t[0] / t[2]).item(), f"eval/acc@{k}": (t[1] / t[3]).item()}


def eval_sampling_params(args, step: int, prompt_indices) -> list:
    """Sampled-evaluation parameters, one seed per held-out prompt (by its index in the whole
    set), so every prompt has its own random stream whatever the number of ranks."""
    from vllm import SamplingParams

    return [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_response_len,
                           n=args.eval_samples, seed=sampling_seed(args.seed + 1, step, i, args.eval_samples))
            for i in prompt_indices]


def rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(engine, tokenizer, root: Path, step: int, trainer_state: dict, rank: int, keep_last: int) -> None:
    """Full training state and a Hugging Face export in root/step_N, atomically.

    Everything goes to step_N.tmp first: every rank's ZeRO-3 model/optimizer/scheduler shards
    and RNG states (state/), the step and data position (trainer_state.json), and the HF
    export (config, safetensors, tokenizer), gathered one parameter at a time. Only then does
    rank 0 rename it to step_N and point `latest` at it, so a kill at any moment leaves
    `latest` on a complete checkpoint. Full states beyond the last `keep_last` are deleted;
    the HF exports stay, for evaluating every checkpoint of a run.
    """
    import shutil

    import deepspeed
    import torch.distributed as dist

    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    engine.save_checkpoint(str(tmp), tag="state", save_latest=False)
    torch.save(rng_state(), tmp / "state" / f"rng_rank{rank}.pt")
    weights = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if rank == 0:
                weights[name] = param.data.detach().cpu().clone()
    if rank == 0:
        engine.module.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state))
    if os.environ.get("GRPO_FAULT_KILL_IN_SAVE") == str(step):  # fault injection for the crash tests
        os.kill(os.getpid(), 9)
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        (root / "latest.tmp").write_text(final.name)
        os.replace(root / "latest.tmp", root / "latest")
        states = sorted(p.parent for p in root.glob("step_*/state") if not p.parent.name.endswith(".tmp"))
        for old in states[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old / "state", ignore_errors=True)
    dist.barrier()


def checkpoint_problem(ckpt: Path, world: int) -> str | None:
    """Why `world` ranks cannot resume from `ckpt`, or None when every file it needs is there."""
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if not isinstance(state, dict) or not {"step", "order", "bad_streak"} <= set(state):
            return "trainer_state.json lacks step / order / bad_streak"
    except (OSError, ValueError) as e:
        return f"trainer_state.json: {first_line(e)}"
    files = [f for f in (ckpt / "state").glob("*") if f.is_file()]
    if not files:
        return "no state/ (pruned by --keep-last, or never written)"
    ranks = sum(f.name.startswith("rng_rank") for f in files)
    if ranks != world:
        return f"written by {ranks} ranks, this launch has {world}: launch it with {ranks}"
    names = {f.name for f in files}
    for r in range(world):  # what each rank reads: DeepSpeed's ZeRO-3 shards of that rank, and its RNG states
        shard = f"zero_pp_rank_{r}_mp_rank_00"
        optim = {f"{shard}_optim_states.pt", f"bf16_{shard}_optim_states.pt"}  # fp32 / bf16 runs
        missing = [n for n in (f"rng_rank{r}.pt", f"{shard}_model_states.pt") if n not in names] + \
            ([] if optim & names else [f"{shard}_optim_states.pt"])
        if missing:
            return f"state/{missing[0]} is missing"
    # torch.save writes a zip archive whose directory sits at its end: a truncated file has none
    damaged = next((f.name for f in sorted(files) if f.suffix == ".pt" and not zipfile.is_zipfile(f)), None)
    return f"state/{damaged} is damaged (not a complete torch file)" if damaged else None


def resumable_checkpoints(root: Path, world: int) -> list[Path]:
    """Complete checkpoints of the run, newest first; rank 0 says why it skips any newer one.

    A run directory that has checkpoints but none complete is an error: starting afresh would
    overwrite its metrics and checkpoints.
    """
    found = sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)
    complete, skipped = [], []
    for ckpt in found:
        problem = checkpoint_problem(ckpt, world)
        if problem is None:
            complete.append(ckpt)
        elif not complete:
            skipped.append(f"{ckpt.name} ({problem})")
    if found and not complete:
        raise ValueError(f"{root} holds checkpoints but none can be resumed: {'; '.join(skipped[:3])}; "
                         "use another --output-dir, or move the run away to start afresh")
    if skipped and int(os.environ.get("RANK", "0")) == 0:
        print(f"[grpo] skipping incomplete checkpoint(s): {'; '.join(skipped)}", flush=True)
    return complete


def damaged_shard(ckpt: Path, rank: int) -> str | None:
    """A file of this rank's share of `ckpt` whose contents fail their CRC, or None. Each rank reads
    its own files once (torch.save writes uncompressed zip archives with a CRC per record), so every
    rank knows before DeepSpeed's load, whose collectives a rank that fails half-way would desert."""
    for f in sorted((ckpt / "state").glob(f"*rank{rank}.pt")) + sorted((ckpt / "state").glob(f"*_rank_{rank}_*.pt")):
        try:
            with zipfile.ZipFile(f) as z:
                if z.testzip() is not None:
                    return f"{ckpt.name}/state/{f.name} is damaged"
        except (OSError, zipfile.BadZipFile) as e:
            return f"{ckpt.name}/state/{f.name} is damaged ({first_line(e)})"
    return None


def load_training_state(engine, ckpt: Path, rank: int) -> dict:
    """Model, optimizer, scheduler, RNG and trainer state from `ckpt` (checked by damaged_shard first)."""
    load_path, _ = engine.load_checkpoint(str(ckpt), tag="state")
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint in {ckpt}/state")
    set_rng_state(torch.load(ckpt / "state" / f"rng_rank{rank}.pt", weights_only=False))
    return json.loads((ckpt / "trainer_state.json").read_text())


# may differ between the launches of one run (the directory is the run, wherever it is)
RUN_ARGS_IGNORED = {"resume", "local_rank", "pad_id", "steps", "reward_workers", "eval_interval", "save_interval",
                    "keep_last", "max_bad_steps", "output_dir"}


def check_output_dir(args, out_dir: Path, world: int) -> list[Path]:
    """Checkpoints to resume from, newest first; refuses to mix two runs in one directory.

    args.json is written with a run's checkpoints: only a run that has trained binds its
    directory, so a launch that failed before its first checkpoint can be corrected.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--output-dir {out_dir} is a file, not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".write-test-")  # unique across nodes
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"--output-dir {out_dir} is not writable ({first_line(e)})") from None
    checkpoints = resumable_checkpoints(out_dir / "checkpoints", world)
    old_args = out_dir / "args.json"
    if old_args.exists() and not args.resume:
        try:
            old = json.loads(old_args.read_text())
        except ValueError:
            raise ValueError(f"{old_args} is not valid JSON: repair or remove it") from None
        new = vars(args)
        diff = [k for k in sorted(set(old) | set(new)) if k not in RUN_ARGS_IGNORED and old.get(k) != new.get(k)]
        if diff:
            shown = ", ".join(f"--{k.replace('_', '-')} {old.get(k)} -> {new.get(k)}" for k in diff[:4])
            raise ValueError(f"{out_dir} holds a run with other arguments ({shown}); "
                             "use another --output-dir, or --resume to continue it with these")
    return checkpoints


def rollout_metrics(rollouts: list[dict], group_size: int) -> dict[str, float]:
    """Rank-local sums for the paper's diagnostics; reduced over ranks by the caller."""
    m = dict.fromkeys(["groups", "length_cv", "zero_var_groups", "mixed_groups", "length_gap"], 0.0)
    for g in range(0, len(rollouts), group_size):
        grp = rollouts[g : g + group_size]
        L = torch.tensor([r["length"] for r in grp], dtype=torch.float64)
        r = torch.tensor([r["reward"] for r in grp], dtype=torch.float64)
        adv = torch.tensor([x["advantage"] for x in grp])
        m["groups"] += 1
        m["length_cv"] += (L.std(unbiased=False) / L.mean()).item()  # std/mean within the group
        m["zero_var_groups"] += float(r.std() == 0)
        if (adv > 0).any() and (adv < 0).any():  # mixed group: positive-negative length gap
            m["mixed_groups"] += 1
            m["length_gap"] += (L[adv < 0].mean() - L[adv > 0].mean()).item()
    m["responses"] = len(rollouts)
    m["reward"] = sum(r["reward"] for r in rollouts)
    m["correct"] = sum(r["reward"] > 0 for r in rollouts)
    m["length"] = sum(r["length"] for r in rollouts)
    m["truncated"] = sum(r["truncated"] for r in rollouts)
    return m


# -----------------------------------------------------------------------------


def deepspeed_config(args, world: int, bf16: bool | None = None) -> dict:
    """The file's optimizer and ZeRO settings, with batch sizes, lr and precision from the flags.

    bf16 (default: on CUDA): bf16 weights and activations, but the micro-batches' gradients are
    reduced across ranks and accumulated in fp32 (DeepSpeed would otherwise do both in bf16,
    rounding 16 micro-batches' sums to 8 bits of mantissa); the file may override either.
    """
    try:
        cfg = json.loads(Path(args.ds_config).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--ds-config {args.ds_config}: {first_line(e)}") from None
    if not isinstance(cfg, dict) or not all(isinstance(cfg.get(k, {}), dict) for k in ("optimizer",
                                                                                        "zero_optimization")):
        raise ValueError(f"--ds-config {args.ds_config}: must hold a JSON object, as ds_config.json does")
    per_rank = args.prompts_per_step // world * args.group_size // args.minibatches
    gas = math.ceil(per_rank / args.micro_batch_size)
    sizes = dict(train_micro_batch_size_per_gpu=args.micro_batch_size, gradient_accumulation_steps=gas,
                 train_batch_size=args.micro_batch_size * gas * world)
    for k, v in sizes.items():  # batch sizes come from the flags; a config may only agree with them
        if k in cfg and cfg[k] not in (v, "auto"):
            raise ValueError(f"--ds-config sets {k}={cfg[k]} but the flags imply {v}; remove it from the config")
    bf16 = torch.cuda.is_available() if bf16 is None else bf16
    cfg.update(sizes, bf16={"enabled": bf16})
    if bf16:
        cfg.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
        cfg.setdefault("communication_data_type", "fp32")
    optimizer = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    optimizer.setdefault("params", {}).update(lr=args.lr, weight_decay=args.weight_decay)
    offload = cfg.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    if optimizer.get("type", "").lower() in ("adam", "adamw") and not offload:
        # torch.optim.AdamW instead of DeepSpeed's FusedAdam, which is JIT-compiled on first use
        # (nvcc on a CUDA node; minutes on a CPU); on CUDA its fused kernel (a ZeRO-3 partition is
        # one flat fp32 tensor per group). Optimizer offload keeps DeepSpeed's CPU Adam.
        optimizer["params"].setdefault("torch_adam", True)
        if bf16:
            optimizer["params"].setdefault("fused", True)
    return cfg


def linear_warmup(num_updates: int):
    """lr x min(1, k / num_updates) for the k-th optimizer update (k = 1, 2, ...): the first update
    already moves the weights (DeepSpeed's WarmupLR gives it lr 0)."""
    from torch.optim.lr_scheduler import LambdaLR

    return lambda optimizer: LambdaLR(optimizer, lambda done: min(1.0, (done + 1) / num_updates))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out_dir = Path(args.output_dir)
    try:
        check_args(args, world)
        ds_config = deepspeed_config(args, world)
        checkpoints = check_output_dir(args, out_dir, world)
    except ValueError as e:
        sys.exit(f"train_grpo.py: error: {e}")
    if "MASTER_PORT" not in os.environ:  # plain `python train_grpo.py` runs as one rank, on a free port
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)

    import deepspeed
    import torch.distributed as dist
    import transformers
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import HfDeepSpeedConfig
    from vllm import SamplingParams

    from rewards import SandboxUnavailable, compute_rewards

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    # on the CPU, DeepSpeed prints "deepspeed_shm_comm_op built successfully" at every start
    with contextlib.nullcontext() if cuda else contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    if not cuda:  # after the first start's JIT build of DeepSpeed's CPU comm op, which may use every core
        # ranks on this node: torchrun says LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE
        pin_cpu_rank(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world))))
    transformers.utils.logging.disable_progress_bar()  # one bar per checkpoint export otherwise
    rank = dist.get_rank()
    # Every rank must see the same run: the output directory is shared between nodes.
    token = all_gather_objects(f".shared-{os.urandom(8).hex()}" if rank == 0 else None)[0]
    if rank == 0:
        (out_dir / token).write_text("")
    dist.barrier()
    seen = all_gather_objects(((out_dir / token).exists(), [c.name for c in checkpoints]))
    dist.barrier()
    if rank == 0:
        (out_dir / token).unlink()
    if not all(s == seen[0] for s in seen) or not seen[0][0]:
        sys.exit(f"train_grpo.py: error: rank {rank}: the ranks do not see the same {out_dir} "
                 "(--output-dir must be one directory shared by every node)")
    done = json.loads((checkpoints[0] / "trainer_state.json").read_text())["step"] if checkpoints else 0
    if done >= args.steps:  # a finished run: say so without starting any engine
        if rank == 0:
            print(f"[grpo] {out_dir} already holds all {args.steps} steps ({checkpoints[0].name}): nothing to do "
                  "(raise --steps to train on, or pick another --output-dir)", flush=True)
        return
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    try:
        from data.demo import model_dir

        if local_rank == 0:
            model_dir(args.model)  # an offline policy is copied into this node's cache once
        dist.barrier()
        model_path = model_dir(args.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        context = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
        if context and args.max_prompt_len + args.max_response_len > context:
            raise ValueError(f"--max-prompt-len + --max-response-len = {args.max_prompt_len + args.max_response_len} "
                             f"exceeds the model's context of {context} tokens")
        args.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        train_rows, dropped = load_prompts(args.dataset, tokenizer, args, train=True)
        eval_rows = load_prompts(args.eval_dataset, tokenizer, args, args.eval_limit)[0] if args.eval_dataset else []
        if any(r["kind"] == "code" for r in train_rows + eval_rows):
            from rewards import sandbox_mode

            sandbox_mode()  # code rewards fail closed without bubblewrap: say so before any engine starts
    except (ValueError, OSError, SandboxUnavailable) as e:
        sys.exit(f"train_grpo.py: error: {first_line(e)}")

    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841  (makes from_pretrained load partitioned)
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    except Exception as e:  # a damaged or missing weights file, of whatever error type the loader raises
        sys.exit(f"train_grpo.py: error: cannot load the model from {model_path} ({first_line(e)})")
    if args.gradient_checkpointing or (args.gradient_checkpointing is None and cuda):
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # warm-up over --lr-warmup-steps rollout steps, unless the DeepSpeed config brings its own schedule
    warmup = args.lr_warmup_steps * args.minibatches
    schedule = linear_warmup(warmup) if warmup > 0 and "scheduler" not in ds_config else None
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=ds_config,
                                      lr_scheduler=schedule)
    ref_engine = None
    if args.kl_coef > 0:
        ref_cfg = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        ref_engine = deepspeed.initialize(model=ref, config=ref_cfg)[0]
    llm = make_vllm(model_path, args, rank, local_rank)

    start, order, bad_streak, resume_from = 0, [], 0, None
    for ckpt in checkpoints:  # newest first; one whose files fail their CRC on any rank: the one before
        errors = [e for e in all_gather_objects(damaged_shard(ckpt, rank)) if e]
        if not errors:
            state = load_training_state(engine, ckpt, rank)
            start, order, bad_streak, resume_from = state["step"], state["order"], state["bad_streak"], ckpt
            sync_weights_to_vllm(engine, llm)
            break
        if rank == 0:
            print(f"[grpo] {errors[0]}: " + ("falling back to the previous checkpoint" if ckpt != checkpoints[-1]
                                             else "no earlier checkpoint"), flush=True)
    if checkpoints and resume_from is None:
        sys.exit(f"train_grpo.py: error: no checkpoint of {out_dir / 'checkpoints'} could be loaded; "
                 "repair the named file, or use another --output-dir")
    if rank == 0 and resume_from is None and (out_dir / "metrics.jsonl").exists():
        logged = sum(1 for x in (out_dir / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] > 0)
        if logged:
            print(f"[grpo] {out_dir} has {logged} logged steps but no checkpoint: starting afresh over them",
                  flush=True)
    if rank == 0:
        print(f"[grpo] {len(train_rows)} training prompts ({dropped} too long, dropped), "
              f"{len(eval_rows)} eval prompts, {world} ranks, agg={args.agg}", flush=True)
        if resume_from is not None:
            print(f"[grpo] resuming from {resume_from} (step {start})", flush=True)
        logged = (out_dir / "metrics.jsonl").read_text().splitlines() if (out_dir / "metrics.jsonl").exists() else []
        # steps after the checkpoint are redone: drop their log lines (TensorBoard: purge_step)
        (out_dir / "metrics.jsonl").write_text("".join(x + "\n" for x in logged if json.loads(x)["step"] <= start))
    writer = SummaryWriter(str(out_dir / "tb"), purge_step=start + 1) if rank == 0 else None

    def log(step: int, metrics: dict[str, float]) -> None:
        if rank == 0:
            for k, v in metrics.items():
                writer.add_scalar(k, v, step)
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    if eval_rows and start == 0:
        ev = evaluate(llm, eval_rows, args, rank, world, 0, out_dir)
        log(0, ev)
        if rank == 0:
            print("[grpo] step 0 eval: " + "  ".join(f"{k} {v:.3f}" for k, v in ev.items()), flush=True)

    n_prompts = args.prompts_per_step // world
    metrics = {}
    bar = tqdm(range(start + 1, args.steps + 1), desc=f"grpo[{args.agg}]", disable=rank != 0, dynamic_ncols=True,
               initial=start, total=args.steps)
    for step in bar:
        timer = {}
        # 1. rollout: this rank's prompts, the same global order on every rank (seeded epochs)
        t0 = time.time()
        while len(order) < args.prompts_per_step:
            epoch = list(range(len(train_rows)))
            random.Random(args.seed + len(order) + step).shuffle(epoch)
            order += epoch
        batch_idx, order = order[: args.prompts_per_step], order[args.prompts_per_step :]
        mine = batch_idx[rank * n_prompts : (rank + 1) * n_prompts]
        rows = [train_rows[i] for i in mine]
        params = [SamplingParams(n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                                 max_tokens=args.max_response_len,
                                 seed=sampling_seed(args.seed, step, rank * n_prompts + j, args.group_size))
                  for j in range(len(rows))]
        outputs = generate(llm, rows, params)
        if cuda:
            # Level 2 discards the weights instead of copying them to host memory (15 GB per rank
            # at 7B, each step): the sync reloads them anyway. Hands the KV cache back to training.
            llm.sleep(level=2)
            torch.cuda.empty_cache()
        timer["rollout"] = time.time() - t0

        # 2. reward
        t0 = time.time()
        rollouts = to_rollouts(rows, outputs)
        rstats = {}
        scores = compute_rewards([r["text"] for r in rollouts], [reference(r["row"]) for r in rollouts],
                                 [r["row"]["kind"] for r in rollouts], args.reward_workers, stats=rstats)
        timer["reward"] = time.time() - t0

        # 3. advantages and 4. aggregation weights, once per rollout batch
        rewards = torch.tensor(scores, dtype=torch.float64)
        adv = group_advantages(rewards, args.group_size, scale_by_std=not args.no_std_norm)
        if os.environ.get("GRPO_FAULT_NAN_STEP") == str(step):  # fault injection for the crash tests
            adv = torch.full_like(adv, float("nan"))
        for r, s, a in zip(rollouts, scores, adv.tolist()):
            r["reward"], r["advantage"] = s, a
        lengths = torch.tensor([r["length"] for r in rollouts])

        # old log-probs only when the policy moves between mini-batches; ref only with KL
        t0 = time.time()
        if args.minibatches > 1:
            fill_logprobs(engine, rollouts, "old_logp", args, device)
        if ref_engine is not None:
            fill_logprobs(ref_engine, rollouts, "ref_logp", args, device)
        timer["logprobs"] = time.time() - t0

        # 5. update: mini-batches of whole groups; weights normalised per mini-batch
        t0 = time.time()
        lr = engine.get_lr()[0]  # of this step's first update
        engine.train()
        per_mb = len(rollouts) // args.minibatches
        keys = ["pg_loss", "tokens", "clipped", "approx_kl", "grad_norm", "skipped_updates", "updates"]
        sums = dict.fromkeys(keys + (["ref_kl"] if ref_engine is not None else []), 0.0)
        # No learning signal anywhere (every group has zero reward variance, no KL term):
        # skip the update rather than let AdamW's momentum and decay move the weights.
        signal_ = all_reduce([float(bool((adv != 0).any()) or args.kl_coef > 0)], op="max")
        kept = torch.where(torch.tensor([r["truncated"] for r in rollouts]), 0, lengths) if args.mask_truncated \
            else lengths
        batch_lengths = all_reduce(sign_lengths(adv, kept)) if args.agg == "balanced-batch" else None
        for mb in range(args.minibatches if signal_.item() else 0):
            part = rollouts[mb * per_mb : (mb + 1) * per_mb]
            a, L = adv[mb * per_mb : (mb + 1) * per_mb], lengths[mb * per_mb : (mb + 1) * per_mb]
            # local groups / global groups of this mini-batch: rank-local weights sum to the global mean
            if args.mask_truncated:  # overlong filtering: truncated responses carry no loss and no tokens
                masked = torch.tensor([r["truncated"] for r in part])
                L = torch.where(masked, 0, L)
            w = aggregation_weights(a, L, args.group_size, args.agg, batch_lengths) / world
            if args.mask_truncated:
                w = torch.where(masked, 0.0, w)
            s = update_minibatch(engine, part, w, args, world, device)
            # DeepSpeed skips the optimizer step itself when the gradient norm is not finite
            bad = not (math.isfinite(s["grad_norm"]) and math.isfinite(s["pg_loss"]))
            sums["skipped_updates"] += bad / world
            for k, v in s.items():
                sums[k] += v if not bad else 0.0
            sums["updates"] += (not bad) / world
        timer["update"] = time.time() - t0
        if cuda:  # this rank's peak of the update (PyTorch's allocator), and the whole device in use
            free, total = torch.cuda.mem_get_info()
            gpu_memory = [torch.cuda.max_memory_allocated() / 2**30, (total - free) / 2**30]
            torch.cuda.reset_peak_memory_stats()

        # 6. weight sync
        t0 = time.time()
        if cuda:
            torch.cuda.empty_cache()  # the update's cached blocks, so that vLLM can take its memory back
            llm.wake_up(tags=["weights"])
        sync_weights_to_vllm(engine, llm)
        if cuda:
            torch.cuda.empty_cache()
            llm.wake_up(tags=["kv_cache"])
        timer["sync"] = time.time() - t0

        # logging: reduce rank-local sums over ranks
        m = rollout_metrics(rollouts, args.group_size)
        local = {**m, **sums, "timeouts": rstats.get("timeouts", 0), "errors": rstats.get("errors", 0)}
        local = dict(sorted(local.items()))  # the same keys in the same order on every rank
        tot = dict(zip(local, all_reduce(list(local.values())).tolist()))
        max_len = all_reduce([float(lengths.max())], op="max")
        metrics = {
            "reward/mean": tot["reward"] / tot["responses"],
            "reward/accuracy": tot["correct"] / tot["responses"],
            "loss/pg": tot["pg_loss"] / max(1, tot["updates"]),
            "loss/clip_frac": tot["clipped"] / max(1, tot["tokens"]),
            "loss/approx_kl": tot["approx_kl"] / max(1, tot["tokens"]),
            "loss/grad_norm": tot["grad_norm"] / world / max(1, tot["updates"]),
            "train/skipped_updates": tot["skipped_updates"],
            "train/no_signal": float(not signal_.item()),
            "lr": lr,
            "length/mean": tot["length"] / tot["responses"],
            "length/max": max_len.item(),
            "length/cv": tot["length_cv"] / tot["groups"],
            "length/pos_neg_gap": tot["length_gap"] / tot["mixed_groups"] if tot["mixed_groups"] else 0.0,
            "groups/zero_var_share": tot["zero_var_groups"] / tot["groups"],
            "length/truncation_rate": tot["truncated"] / tot["responses"],
            "reward/timeouts": tot["timeouts"],
            "reward/errors": tot["errors"],
            **{f"time/{k}": v for k, v in timer.items()},
        }
        if ref_engine is not None:
            metrics["loss/ref_kl"] = tot["ref_kl"] / max(1, tot["tokens"])
        if cuda:
            peak, used = all_reduce(gpu_memory, "max").tolist()
            metrics["memory/update_peak_gib"], metrics["memory/device_used_gib"] = peak, used

        if eval_rows and (step % args.eval_interval == 0 or step == args.steps):
            metrics.update(evaluate(llm, eval_rows, args, rank, world, step, out_dir))
        log(step, metrics)
        bar.set_postfix(acc=f"{metrics['reward/accuracy']:.3f}", pg=f"{metrics['loss/pg']:+.4f}",
                        len=f"{metrics['length/mean']:.0f}", refresh=False)
        bad_streak = bad_streak + 1 if tot["skipped_updates"] else 0
        stop = bad_streak >= args.max_bad_steps
        if step % args.save_interval == 0 or step == args.steps or stop:
            state = {"step": step, "order": order, "bad_streak": bad_streak}
            save_checkpoint(engine, tokenizer, out_dir / "checkpoints", step, state, rank, args.keep_last)
            if rank == 0:  # the arguments that trained these checkpoints
                (out_dir / "args.json").write_text(json.dumps(vars(args), indent=1))
        if stop:
            dist.barrier()
            sys.exit(f"train_grpo.py: error: {bad_streak} steps in a row had a non-finite loss or gradient "
                     f"(updates skipped, weights unchanged); stopped with a checkpoint at step {step}")

    if rank == 0:
        final = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if final:
            print("[grpo] done: " + "  ".join(f"{k} {v:.3f}" for k, v in final.items()), flush=True)
        print(f"[grpo] run in {out_dir}/: metrics.jsonl, tb/ (TensorBoard), checkpoints/", flush=True)
        writer.close()
    dist.barrier()


if __name__ == "__main__":
    main()
