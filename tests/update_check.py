"""The trainer's update path without vLLM, at a real model's shapes: what a GPU node with DeepSpeed but no vLLM
can check. Launched on every rank by DeepSpeed's launcher:

    python -m deepspeed.launcher.runner --num_gpus N tests/update_check.py --shape qwen2.5-1.5b --out DIR

A random-weight model of the shape (bench_step.SHAPES; no hub) is saved and loaded by the trainer's own
build_trainer: ZeRO-3 (bf16 with fp32 gradient accumulation and torch's fused AdamW on CUDA), gradient
checkpointing, a frozen reference engine for a KL term. Three GRPO updates on synthetic responses through the
trainer's functions (fill_logprobs for old and reference log-probs, loss_weights, update_minibatch with chunked
log-probs); a checkpoint after the first (save_checkpoint); then load_training_state from it and the second
update again, which must reproduce the first time's fp32 master weights: bit for bit on the CPU and on CUDA with
--deterministic; in CUDA's default mode (non-deterministic attention backward and atomics) the redo's distance
from the first time, relative to the update's own change (L2 norms over all ranks' partitions), must be at most
REDO_TOLERANCE. That criterion is judged on the spot: the same redo from a resume broken on purpose (Adam's
moments not restored; its step count not restored) must exceed it. Also the collective helpers (all_reduce,
all_gather_objects) on the backend's device, and which attention the packed update ran (ATTENTION_CALLS,
beside attention_kind's: one line). Each rank writes DIR/update_check_rankR.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import train_grpo  # noqa: E402
from grpo_utils import checkpoints, distributed  # noqa: E402
from grpo_utils.batching import ATTENTION_CALLS, attention_kind, micro_batching  # noqa: E402
from grpo_utils.checkpoints import checkpoint_problem  # noqa: E402
from grpo_utils.flags import check_args  # noqa: E402
from grpo_utils.memory import measured_budget, micro_batch_bytes  # noqa: E402
from scripts.bench_step import SHAPES, synthetic_rollouts  # noqa: E402

# a redo within this share of the update's own change is kernel noise; a broken resume moves the update by far
# more (measured on the CPU: see tests/test_gpu_check.py and docs/gpu.md)
REDO_TOLERANCE = 0.1
FAULTS = ("moments", "step")  # what a broken resume could fail to restore
# ATTENTION_CALLS's paths: which attention the packed update ran
ATTENTION_PATHS = {"flash": "varlen_attn", "math": "scaled_dot_product_attention per sequence, math kernel",
                   "sdpa": "scaled_dot_product_attention per sequence", "sdpa-masked": "SDPA with a padding mask"}


def random_model(shape: str, out: Path, max_len: int) -> None:
    """A random-weight model of `shape` with the demo's tokenizer, as from_pretrained loads it (rank 0)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from data.demo import model_dir

    cuda = torch.cuda.is_available()
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=max(4096, max_len), rope_theta=1e6,
                      rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):  # initialising 1.5B weights on the CPU takes minutes
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir("demo")).save_pretrained(out)


def update(engine, ref_engine, args, batching, step: int, rank: int, device) -> dict[str, float]:
    """One rollout batch's update as main() runs it, on synthetic groups: old and reference log-probs,
    aggregation weights, then the mini-batches."""
    n = args.prompts_per_step // int(os.environ["WORLD_SIZE"]) * args.group_size
    rollouts = synthetic_rollouts(n, args.max_prompt_len, args.max_response_len, engine.module.config.vocab_size,
                                  seed=10_000 * step + rank)
    rewards = torch.tensor([float((7 * i + step) % 3 == 0) for i in range(n)], dtype=torch.float64)
    adv = train_grpo.group_advantages(rewards, args.group_size)
    for r, a in zip(rollouts, adv.tolist()):
        r["advantage"] = a
    train_grpo.fill_logprobs(engine, rollouts, "old_logp", args, batching, device)
    train_grpo.fill_logprobs(ref_engine, rollouts, "ref_logp", args, batching, device)
    weights = train_grpo.loss_weights(adv, rollouts, args)
    engine.train()
    sums, per_mb = {}, n // args.minibatches
    for mb in range(args.minibatches):
        part = slice(mb * per_mb, (mb + 1) * per_mb)
        for k, v in train_grpo.update_minibatch(engine, rollouts[part], weights[part], args, batching, device).items():
            sums[k] = sums.get(k, 0.0) + v
    return sums


def break_resume(engine, fault: str) -> None:
    """Undo part of what load_training_state restored: Adam's moments, or its step count (bias correction)."""
    for state in engine.optimizer.optimizer.state.values():
        if fault == "moments":
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
        elif torch.is_tensor(state["step"]):
            state["step"].zero_()
        else:
            state["step"] = 0


def relative_distance(xs: list[torch.Tensor], ys: list[torch.Tensor], bs: list[torch.Tensor]) -> float:
    """||x - y|| / ||y - b|| over every rank's partitions: a redo x against the update y from b."""
    num = sum(((x - y).double() ** 2).sum().item() for x, y in zip(xs, ys))
    den = sum(((y - b).double() ** 2).sum().item() for y, b in zip(ys, bs))
    num, den = distributed.all_reduce([num, den]).tolist()
    return (num / den) ** 0.5 if den > 0 else float("inf")


def master_weights(engine) -> list[torch.Tensor]:
    """This rank's partition of the fp32 master weights (ZeRO-3's optimizer), copied to the CPU."""
    return [t.detach().float().cpu().clone() for t in engine.optimizer.fp32_partitioned_groups_flat]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    p.add_argument("--out", required=True)
    p.add_argument("--prompts-per-rank", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=768)
    p.add_argument("--deterministic", action="store_true", help="the trainer's --deterministic: a bit-exact redo")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="the trainer's flag (default: the trainer's)")
    p.add_argument("--lora-rank", type=int, default=0, help="the trainer's --lora-rank: adapters, the base frozen")
    p.add_argument("--lr", default="1e-5", help="the trainer's --lr")
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()
    if a.deterministic:
        distributed.make_deterministic()
    out, world = Path(a.out), int(os.environ.get("WORLD_SIZE", "1"))
    out.mkdir(parents=True, exist_ok=True)
    rank, local_rank = distributed.init_distributed(out, [], world)
    import torch.distributed as dist
    from transformers import AutoTokenizer

    model_dir = out / "model"
    if rank == 0:
        random_model(a.shape, model_dir, a.prompt_len + a.response_len)
    dist.barrier()
    args = train_grpo.parse_args(["--model", str(model_dir), "--output-dir", str(out / "run"), "--group-size", "4",
                                  "--prompts-per-step", str(a.prompts_per_rank * world), "--minibatches", "2",
                                  "--logprob-chunk", "64", "--kl-coef", "0.01",
                                  "--gradient-checkpointing", "--lr", a.lr, "--lr-warmup-steps", "0",
                                  "--max-prompt-len", str(a.prompt_len), "--max-response-len", str(a.response_len),
                                  "--lora-rank", str(a.lora_rank)]
                                 + ["--deterministic"] * a.deterministic
                                 + (["--micro-batch-tokens", str(a.micro_batch_tokens)]
                                    if a.micro_batch_tokens is not None else []))
    check_args(args, world, train_grpo.POLICY_LOSS_DEFAULTS[args.policy_loss], train_grpo.OFFLINE_DEFAULTS)
    batching = micro_batching(args)  # pad id 0
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    engine, ref_engine = train_grpo.build_trainer(args, str(model_dir), train_grpo.deepspeed_config(args, world))
    memory = None
    if batching.micro_batch_tokens is None:  # CUDA: as the trainer sizes it at its first update
        batching.micro_batch_tokens, memory = measured_budget(engine, args, a.prompt_len + a.response_len)
    held = torch.cuda.memory_allocated() if cuda else 0
    # what the optimizer has yet to make (Adam's moments, at its first step): part of the peak from then on
    to_come = train_grpo.states_to_come(engine, memory) if memory is not None else 0.0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    optimizer = engine.optimizer.optimizer
    result = {"rank": rank, "world": world, "shape": a.shape, "device": str(device),
              "params": sum(getattr(q, "ds_numel", q.numel()) for q in engine.module.parameters()),
              "bf16": engine.bfloat16_enabled(), "optimizer": type(optimizer).__name__,
              "fused": optimizer.defaults.get("fused"), "zero_stage": engine.zero_optimization_stage(),
              "checkpointing": engine.module.is_gradient_checkpointing, "deterministic": a.deterministic,
              "micro_batch_tokens": batching.micro_batch_tokens,
              "collective_device": str(distributed.collective_device()),
              "all_reduce": [distributed.all_reduce([rank, 1.0]).tolist(),
                             distributed.all_reduce([rank], "max").tolist()],
              "all_gather_objects": distributed.all_gather_objects({"rank": rank})}

    t0 = time.time()
    first = update(engine, ref_engine, args, batching, 1, rank, device)
    result["step_s"] = time.time() - t0
    root = out / "run" / "checkpoints"
    checkpoints.save_checkpoint(engine, tokenizer, root, 1, {"step": 1, "order": [], "bad_streak": 0}, rank,
                                keep_last=2, weights=train_grpo.policy_weights(engine))
    saved = master_weights(engine)
    straight = update(engine, ref_engine, args, batching, 2, rank, device)
    after = master_weights(engine)

    result["checkpoint_problem"] = checkpoint_problem(root / "step_000001", world)
    result["resumed_step"] = train_grpo.load_training_state(engine, root / "step_000001", rank, args)["step"]
    loaded = master_weights(engine)
    again = update(engine, ref_engine, args, batching, 2, rank, device)
    redone = master_weights(engine)
    change = max((b - s).abs().max().item() for s, b in zip(saved, after))
    result.update(
        first=first, straight=straight, again=again, change=change,
        loaded_diff=max((x - s).abs().max().item() for s, x in zip(saved, loaded)),
        redone_diff=max((x - b).abs().max().item() for b, x in zip(after, redone)),
        redo_rel=relative_distance(redone, after, saved), tolerance=REDO_TOLERANCE, faults={})
    for fault in FAULTS:  # the same redo from a resume broken on purpose: the criterion must catch it
        train_grpo.load_training_state(engine, root / "step_000001", rank, args)
        break_resume(engine, fault)
        update(engine, ref_engine, args, batching, 2, rank, device)
        result["faults"][fault] = relative_distance(master_weights(engine), after, saved)
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    # the attention each packed_attention call ran, beside the one attention_kind reports (the memory model's)
    result["attention"], result["attention_kind"] = dict(ATTENTION_CALLS), attention_kind(args, cuda)
    result["micro_batches"] = first["micro_batches"] / args.minibatches
    if memory is not None:  # the memory model's bound: the states held and to come (Adam's moments), and beside
        # them the larger of a largest micro-batch (its fixed bytes, tokens and gradients in flight) and the optimizer
        # step's transients (the fp32 gradients it flattens, the bf16 copy of the update); the reloads above release
        # the moments before they load (load_training_state), so they hold no more than the states
        per_minibatch = args.prompts_per_step // world * args.group_size // args.minibatches
        largest = min(batching.micro_batch_tokens, per_minibatch * (a.prompt_len + a.response_len))
        transient = max(micro_batch_bytes(memory, largest), memory["step"])
        result["predicted_peak_gib"] = (held + to_come + transient) / 2**30
    (out / f"update_check_rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        print(f"[update check] {a.shape} ({result['params'] / 1e9:.2f}B parameters), {world} rank(s) on "
              f"{device.type}: {result['step_s']:.1f} s per update of {args.prompts_per_step * args.group_size} "
              f"responses; resume: weight diff {result['redone_diff']:.2e} for a change of {change:.2e}, relative "
              f"{result['redo_rel']:.2e} (at most {REDO_TOLERANCE}; broken resumes: "
              + ", ".join(f"{k} {v:.2f}" for k, v in result["faults"].items()) + ")"
              + (f"; peak memory {result['peak_gib']:.1f} GiB" if cuda else "")
              + (f" (memory_model: at most {result['predicted_peak_gib']:.1f} GiB)" if memory else ""), flush=True)
        ran = ", ".join(f"{k} ({ATTENTION_PATHS.get(k, k)}), {n} calls" for k, n in sorted(result["attention"].items()))
        kind = result["attention_kind"]
        print(f"[update check] attention: {ran or 'no calls'}"
              + (f"; not {kind}, which attention_kind reports" if cuda and set(result["attention"]) != {kind} else ""),
              flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
    train_grpo.exit_without_teardown()  # every rank is past the last barrier; gloo's teardown at exit can abort
