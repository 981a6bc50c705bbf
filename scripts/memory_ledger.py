"""Memory ledger: every byte the update holds, measured through the trainer's own code on the CPU.

    python -m scripts.memory_ledger --shape s1 --out ledger.json

Runs the real update (train_grpo.build_trainer's ZeRO-3 engine with torch's AdamW, gradient checkpointing,
packed rows, the chunked log-probs, train_grpo.update: old log-probs, then one optimizer step per mini-batch)
through two rollout steps, a checkpoint and a resume (load_training_state) and a third step, on one rank, in
bf16 as on CUDA (deepspeed_config(bf16=True): bf16 weights and activations, fp32 master weights, gradients
accumulated in fp32). What differs from CUDA and is simulated: the dtype (forced to bf16); the attention kernel
(each sequence through the CPU's SDPA, which holds no scores, as the flash kernel holds none: memory_model's
"flash"); the caching allocator (none on the CPU: live tensor bytes are counted, which is what
torch.cuda.max_memory_allocated reports, fragmentation aside).

How it counts: a TorchDispatchMode sees every tensor an op creates, forward, backward, DeepSpeed's and the
optimizer's alike; each new storage is held by a weak reference whose callback subtracts its bytes when the
last tensor on it goes, so the live bytes at any moment are exact (views share their base's storage and are
counted once). torch's profiler memory timeline would give the same totals but only as a post-hoc trace, and
its categories do not know ZeRO-3's flat partitions; a dispatch mode sees each allocation with the Python stack
that made it, which is what grouping needs. Each storage is put in the group of the innermost frame that names
one (GROUPS), then re-filed by identity once the engine's states exist (parameter partitions, fp32 master
weights, gradient partitions, Adam's moments). The mode is entered before the engine is built, so nothing the
update holds predates it.

Prints, per phase, the peak of live bytes and its groups beside memory.memory_model's prediction of each;
--out writes them as JSON (tests/test_memory_ledger.py holds the model to them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import weakref
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train_grpo  # noqa: E402
from grpo_utils import batching, checkpoints, distributed  # noqa: E402
from grpo_utils.memory import memory_model, micro_batch_bytes, resident_bytes  # noqa: E402
from scripts.bench_step import check_lora_rank, check_out, synthetic_rollouts  # noqa: E402

# Small shapes in Qwen2.5's proportions: intermediate ~5.8 hidden, vocabulary ~100 hidden (the embedding a large
# share of the parameters, as at 0.5B-1.5B), grouped-query heads (6:1, 8:1 and 7:1 as 1.5B, 3B and 7B), head
# dim 32, tied embeddings (1.5B, 3B) and an untied lm_head (7B).
SHAPES = {
    "s1": dict(vocab_size=12_800, hidden_size=128, intermediate_size=768, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    "s2": dict(vocab_size=19_200, hidden_size=192, intermediate_size=1_120, num_hidden_layers=3,
               num_attention_heads=8, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    "s3": dict(vocab_size=25_600, hidden_size=256, intermediate_size=1_472, num_hidden_layers=4,
               num_attention_heads=7, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False),
}

# The ledger's groups, named as memory_model names them: the innermost frame whose function (or file) is listed
# files the allocation (ZeRO-3's gathers inside a forward are "live parameters", not activations).
GROUPS = [
    ("live parameters", ("all_gather", "_allgather", "fetch_sub_module", "_all_gather_params", "allgather_fn")),
    ("log-prob chunk", ("_chunk_logprobs",)),
    ("checkpoint read", ("torch/serialization.py",)),  # on CUDA in host memory (DeepSpeed maps it to the CPU)
    ("checkpoint write", ("save_checkpoint",)),  # the export's CPU copies, on CUDA in host memory
    ("attention", ("packed_attention",)),
    ("optimizer step", ("torch/optim/",)),
    ("gradients and buffers", ("reduce_", "__reduce_and_partition", "partition_grads", "_create_fp16_sub_groups",
                               "independent_gradient_partition", "__add_grad_to_ipg_bucket", "backward_epilogue")),
    ("activations", ("token_logprobs",)),
]


def group_of_stack(phase: str) -> str:
    """The group of an allocation made now: the innermost listed frame's, else by the phase (what the forward,
    the backward and the recomputed forward of a checkpointed layer make is the micro-batch's activations)."""
    f = sys._getframe(2)
    while f is not None:
        name, path = f.f_code.co_name, f.f_code.co_filename
        for group, keys in GROUPS:
            if any(k in name or ("/" in k and k in path) for k in keys):
                return group
        f = f.f_back
    if phase.endswith(("micro-batches", "log-probs")):
        return "activations"
    return "optimizer step" if phase.endswith("optimizer step") else "other"


class Ledger(TorchDispatchMode):
    """Live storage bytes by group, and the peak of their sum with its groups, per phase."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.owner: dict[int, tuple[str, int]] = {}  # storage key -> (group, bytes)
        self.refs: dict[int, weakref.ref] = {}
        self.phase, self.peaks, self.maxima = "init", {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.track(t.untyped_storage())
        return out

    def track(self, st) -> None:
        key = st._cdata
        if key in self.owner:
            group, n = self.owner[key]
            if st.nbytes() != n:  # resized in place (resize_, set_)
                self.bytes[group] += st.nbytes() - n
                self.owner[key] = (group, st.nbytes())
            return
        if st.nbytes() == 0:
            return
        group = group_of_stack(self.phase)
        self.owner[key] = (group, st.nbytes())
        self.bytes[group] += st.nbytes()
        self.refs[key] = weakref.ref(st, lambda _, key=key: self.free(key))
        self.note_peak(group)

    def free(self, key: int) -> None:
        group, n = self.owner.pop(key)
        self.refs.pop(key, None)
        self.bytes[group] -= n

    def refile(self, tensors, group: str) -> None:
        for t in tensors:
            key = t.untyped_storage()._cdata
            if key in self.owner and self.owner[key][0] != group:
                old, n = self.owner[key]
                self.bytes[old] -= n
                self.bytes[group] += n
                self.owner[key] = (group, n)

    def note_peak(self, group: str) -> None:
        maxima = self.maxima.setdefault(self.phase, {})
        for g, b in self.bytes.items():
            maxima[g] = max(maxima.get(g, 0), b)
        total = sum(self.bytes.values())
        peak = self.peaks.get(self.phase)
        if peak is None or total > peak["total"]:
            self.peaks[self.phase] = {"total": total, **{g: b for g, b in self.bytes.items() if b}}

    def snapshot(self) -> dict[str, int]:
        return {"total": sum(self.bytes.values()), **{g: b for g, b in self.bytes.items() if b}}


def predicted_peak(phase: str, model: dict, ledger: dict) -> float | None:
    """memory_model's bound on a phase's peak, from its groups (so that a group left out lowers it): the states,
    then beside them the micro-batch's fixed bytes, gradients in flight and tokens; the optimizer step's
    transients; a forward-only pass's fixed bytes and tokens (at most the budget); a resume's checkpoint read
    beside the states but Adam's moments; a save's gathered parameters."""
    resident = resident_bytes(model)
    step, _, part = phase.partition(": ")
    if part == "micro-batches":
        return resident + micro_batch_bytes(model, ledger["tokens"][step])
    if part == "optimizer step":
        return resident + model["step"]
    if part == "log-probs":
        return resident + micro_batch_bytes(model, ledger["settings"]["micro_batch_tokens"], backward=False)
    if phase in ("resume: load", "reload: load"):  # Adam's moments released before the read (load_training_state)
        return resident - model["optimizer states"] + model["checkpoint read"]
    if phase == "save":
        return resident + micro_batch_bytes(model, 0, backward=False)
    return None


def engine_states(engine) -> dict[str, list[torch.Tensor]]:
    """The tensors the ZeRO-3 engine keeps between steps, by what they are."""
    opt = engine.optimizer
    return {
        "parameter partitions": [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")],
        "master weights": list(opt.fp32_partitioned_groups_flat),
        "gradient partitions": [t for t in [getattr(opt, "grad_partitions_flat_buffer", None)] if t is not None]
        + [g.grad for g in opt.fp32_partitioned_groups_flat if g.grad is not None],
        "optimizer states": [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)],
        "reduce bucket": [b.buffer for b in getattr(opt, "ipg_buckets", {}).values() if torch.is_tensor(b.buffer)],
    }


def refile_states(ledger: Ledger, engine) -> None:
    for group, tensors in engine_states(engine).items():
        ledger.refile(tensors, group)


def random_model(shape: str, out: Path, max_len: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=max(1024, max_len), rope_theta=1e6, rms_norm_eps=1e-6)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)


def build(ledger: Ledger, args, work: Path, ds_config: dict) -> object:
    ledger.phase = "build"
    engine, _ = train_grpo.build_trainer(args, str(work / "model"), ds_config)
    refile_states(ledger, engine)
    return engine


def run_step(ledger: Ledger, engine, args, rollouts: list[dict], adv: torch.Tensor, name: str) -> int:
    """train_grpo.update, its phases named: the old log-probs, the micro-batches' forward and backward, the
    optimizer step (ZeRO-3's at the accumulation boundary, whose gradient norm, clipping and AdamW follow). The
    tokens of the first mini-batch's largest micro-batch."""
    fill, step = train_grpo.fill_logprobs, engine.step

    def fill_logprobs(*a, **k):
        ledger.phase = f"{name}: log-probs"
        fill(*a, **k)
        ledger.phase = f"{name}: micro-batches"

    def engine_step(*a, **k):
        ledger.phase = f"{name}: optimizer step" if engine.is_gradient_accumulation_boundary() else ledger.phase
        step(*a, **k)
        refile_states(ledger, engine)  # Adam's moments, from the first step on
        ledger.phase = f"{name}: micro-batches"

    train_grpo.fill_logprobs, engine.step = fill_logprobs, engine_step
    parts = train_grpo.rank_micro_batches(rollouts[: len(rollouts) // args.minibatches], args.micro_batch_size,
                                          args.micro_batch_tokens, True)
    try:
        train_grpo.update(engine, None, rollouts, adv, args, batching.micro_batching(args), torch.device("cpu"), 1, {})
    finally:
        train_grpo.fill_logprobs = fill
        del engine.step
    refile_states(ledger, engine)
    return max(sum(len(rollouts[i]["tokens"]) for i in b) for b in parts)


def step_rollouts(args, step: int, prompt_len: int, response_len: int) -> tuple[list[dict], torch.Tensor]:
    n = args.prompts_per_step * args.group_size
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rollouts = synthetic_rollouts(n, prompt_len, response_len, vocab, seed=step)
    rewards = torch.tensor([float((7 * i + step) % 3 == 0) for i in range(n)], dtype=torch.float64)
    adv = train_grpo.group_advantages(rewards, args.group_size)
    for r, a in zip(rollouts, adv.tolist()):
        r["advantage"] = a
    return rollouts, adv


def measure(a: argparse.Namespace, work: Path, resume: bool) -> dict:
    """The ledger of a new run's steps 1 and 2 and its checkpoint at step 1, or (resume) of a new process that
    resumes from that checkpoint and redoes step 2, as a relaunched trainer does."""
    from transformers import AutoTokenizer

    from data.demo import model_dir

    rank, _ = distributed.init_distributed(work, [], 1)
    longest = a.prompt_len + a.response_len
    if not resume:
        random_model(a.shape, work / "model", longest)
    args = train_grpo.parse_args(["--model", str(work / "model"), "--output-dir", str(work / "run"),
                                  "--group-size", "4", "--prompts-per-step", str(a.prompts), "--minibatches", "2",
                                  "--logprob-chunk", str(a.logprob_chunk), "--gradient-checkpointing", "--lr", "1e-5",
                                  "--lr-warmup-steps", "0", "--micro-batch-tokens", str(a.micro_batch_tokens),
                                  "--max-prompt-len", str(a.prompt_len), "--max-response-len", str(a.response_len),
                                  "--lora-rank", str(a.lora_rank)])
    ds_config = train_grpo.deepspeed_config(args, 1, bf16=True)
    if a.reduce_bucket is not None:
        ds_config["zero_optimization"]["reduce_bucket_size"] = a.reduce_bucket
    ledger, resident, tokens = Ledger(), {}, {}
    with ledger:
        engine = build(ledger, args, work, ds_config)
        resident["built"] = ledger.snapshot()
        if resume:
            ledger.phase = "resume: load"
            train_grpo.load_training_state(engine, work / "run" / "checkpoints" / "step_000001", rank, args)
            refile_states(ledger, engine)
            resident["resumed"] = ledger.snapshot()
        for step in (2,) if resume else (1, 2):
            name = f"step {step}" + (" after the resume" if resume else "")
            rollouts, adv = step_rollouts(args, step, a.prompt_len, a.response_len)
            tokens[name] = run_step(ledger, engine, args, rollouts, adv, name)
            resident[f"after {name}"] = ledger.snapshot()
            if step == 1:
                ledger.phase = "save"
                checkpoints.save_checkpoint(engine, AutoTokenizer.from_pretrained(model_dir("demo")),
                                         work / "run" / "checkpoints", 1, {"step": 1, "order": [], "bad_streak": 0},
                                         rank, keep_last=2, weights=train_grpo.policy_weights(engine))
        if not resume:  # a reload in the same process, Adam's moments already made (the GPU check's redo)
            ledger.phase = "reload: load"
            train_grpo.load_training_state(engine, work / "run" / "checkpoints" / "step_000001", rank, args)
            refile_states(ledger, engine)
            resident["reloaded"] = ledger.snapshot()
    config = engine.module.config
    zero = engine.config["zero_optimization"]
    return {"peaks": ledger.peaks, "maxima": ledger.maxima, "resident": resident, "tokens": tokens,
            "settings": {"checkpointing": engine.module.is_gradient_checkpointing, "chunk": args.logprob_chunk,
                         "longest": longest, "live_params": engine.zero_max_live_parameters(),
                         "micro_batch_tokens": max(args.micro_batch_tokens, longest),
                         "reduce_bucket": zero.get("reduce_bucket_size", 5e8),
                         "persistence_threshold": zero.get("stage3_param_persistence_threshold", 1e5),
                         "world": 1, "lora_rank": args.lora_rank, "config": config.to_dict()}}


def check_args(a: argparse.Namespace) -> None:
    """Every setting that cannot run, in one line, before the engine starts and minutes of measuring."""
    for k in ("prompt_len", "response_len", "micro_batch_tokens", "logprob_chunk") + ("reduce_bucket",) * (
            a.reduce_bucket is not None):
        if getattr(a, k) < 1:  # a budget of 0 (by --micro-batch-size) is not the one memory_model is held to
            raise ValueError(f"--{k.replace('_', '-')} must be at least 1 (got {getattr(a, k)})")
    if a.prompts < 2 or a.prompts % 2:  # the trainer's rule: each mini-batch takes whole groups
        raise ValueError(f"--prompts must be a positive even number (got {a.prompts}): a step's prompts split into "
                         "2 mini-batches")
    check_lora_rank(a.lora_rank, SHAPES[a.shape]["hidden_size"], f"--shape {a.shape}")
    if a.out:
        check_out(a.out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="s1", choices=list(SHAPES))
    p.add_argument("--out", default=None, help="JSON file for the ledger (default: print only)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=448)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (4 responses each, 2 mini-batches)")
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--logprob-chunk", type=int, default=256)
    p.add_argument("--lora-rank", type=int, default=0, help="the trainer's --lora-rank: adapters, the base frozen")
    p.add_argument("--reduce-bucket", type=int, default=None,
                   help="ZeRO-3's reduce_bucket_size in elements (default: ds_config.json's); below a weight's size, "
                        "its gradient is reduced outside the bucket")
    p.add_argument("--resume-in", default=None, help=argparse.SUPPRESS)  # the resume's own process
    a = p.parse_args(argv)
    try:
        check_args(a)
    except ValueError as e:
        p.error(str(e))
    import subprocess
    import tempfile

    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    if a.resume_in:
        Path(a.resume_in, "resume.json").write_text(json.dumps(measure(a, Path(a.resume_in), resume=True)))
        return {}
    with tempfile.TemporaryDirectory() as work:
        result = measure(a, Path(work), resume=False)
        child = [sys.executable, "-m", "scripts.memory_ledger", *(argv if argv is not None else sys.argv[1:]),
                 "--resume-in", work]
        env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
        subprocess.run(child, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        resumed = json.loads(Path(work, "resume.json").read_text())
    for key in ("peaks", "maxima", "resident", "tokens"):
        result[key].update({k: v for k, v in resumed[key].items() if k not in ("build", "built")})
    st = result["settings"]
    from transformers import Qwen2Config

    # DeepSpeed's CPU accelerator is a synchronised device: one reduction at a time, gloo's reduce-scatter
    result.update(shape=a.shape, model=memory_model(Qwen2Config(**st["config"]), st["checkpointing"], st["chunk"],
                                                     "flash", st["longest"], st["live_params"], st["world"],
                                                     st["reduce_bucket"], st["lora_rank"], synchronized=True))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    cfg = result["settings"]["config"]
    lora = f", LoRA rank {a.lora_rank}: {result['model']['trained'] / 1e6:.3f}M trained" if a.lora_rank else ""
    print(f"[ledger] {a.shape}{lora}: {result['model']['params'] / 1e6:.2f}M parameters (hidden {cfg['hidden_size']}, "
          f"{cfg['num_hidden_layers']} layers), 1 rank, bf16; MiB at each phase's peak")
    for phase, peak in result["peaks"].items():
        bound = predicted_peak(phase, result["model"], result)
        print(f"[ledger] {a.shape} {phase}: peak {peak['total'] / 2**20:.2f}" + (
            f", memory_model {bound / 2**20:.2f} ({bound / peak['total']:.2f} x)" if bound else "") + " = " + ", ".join(
            f"{g} {b / 2**20:.2f}" for g, b in sorted(peak.items()) if g != "total" and b >= 2**20 / 200))
    return result


if __name__ == "__main__":
    main()
    train_grpo.exit_without_teardown()
