"""The step's metrics (rollouts, the update's sums reduced over ranks, rates, memory) and the loggers
(metrics.jsonl, TensorBoard, the console), which a resume continues without a duplicate step."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from grpo_utils.common import first_line
from grpo_utils.distributed import all_reduce
from grpo_utils.flags import flags_with
from grpo_utils.run_dir import logged_lines

# peak dense bf16 tensor TFLOP/s by device name (the first name the device's contains); else --peak-tflops
PEAK_BF16_TFLOPS = {"H100 PCIe": 756, "H100 NVL": 835, "H100": 989, "H200": 989, "H800": 989, "H20": 148,
                    "A100": 312, "A800": 312, "L40S": 362, "B200": 2250, "MI300X": 1307}


def rollout_metrics(rollouts: list[dict], group_size: int) -> dict[str, float]:
    """Rank-local sums for the paper's diagnostics (length CV within each group; negative-positive
    length gap over the groups with both signs); reduced over ranks by step_metrics. Accuracy counts
    the responses the verifier scores 1 (a code answer passing every test, also under --code-reward
    fraction); the mean reward includes --overlong-buffer's shaping."""
    col = lambda k: torch.tensor([float(r[k]) for r in rollouts], dtype=torch.float64).view(-1, group_size)  # noqa: E731
    L, R, A = col("length"), col("reward"), col("advantage")
    mixed = (A > 0).any(1) & (A < 0).any(1)
    gap = (L * (A < 0)).sum(1) / (A < 0).sum(1).clamp(min=1) - (L * (A > 0)).sum(1) / (A > 0).sum(1).clamp(min=1)
    return {"groups": len(L), "length_cv": (L.std(1, unbiased=False) / L.mean(1)).sum().item(),
            "zero_var_groups": (R.std(1) == 0).sum().item(), "mixed_groups": mixed.sum().item(),
            "length_gap": gap[mixed].sum().item(), "responses": L.numel(), "reward": R.sum().item(),
            "correct": (col("score") >= 1).sum().item(), "length": L.sum().item(),
            "truncated": col("truncated").sum().item()}


def model_flops_fn(engine, peak_tflops: float | None):
    """(flops(sequence lengths), peak FLOP/s or None). Model FLOPs of one forward and backward:
    6 N per token for the weight matmuls (N: parameters but an untied input embedding, a lookup) and
    12 layers hidden S per token of an S-token sequence for attention, as in PaLM's MFU (Chowdhery et
    al. 2022, app. B). Recomputation for gradient checkpointing does not count: MFU, not HFU."""
    module, cfg = engine.module, engine.module.config
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731  (ZeRO-3 holds a partition)
    n = sum(numel(p) for p in module.parameters())
    if not getattr(cfg, "tie_word_embeddings", False):
        n -= numel(module.get_input_embeddings().weight)
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    peak = None
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        tflops = peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        peak = tflops * 1e12 if tflops else None
        if peak is None and int(os.environ.get("RANK", "0")) == 0:
            print(f"[grpo] no peak FLOP/s known for {name}: pass --peak-tflops to log perf/mfu", flush=True)
    return (lambda seq_lens: sum(6 * n * s + 12 * layers * hidden * s * s for s in seq_lens)), peak


def gpu_memory() -> list[float]:
    """This rank's peak of PyTorch's allocator since the last call and the whole device in use, GiB."""
    free, total = torch.cuda.mem_get_info()
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return [peak, (total - free) / 2**30]


def resumable_values(engine, args) -> dict[str, float]:
    """hparams/FLAG: what the step ran with of every numeric flag --resume may change (flags_with("resume")): the
    weight decay as the optimizer's parameter groups hold it (the rate, scheduled, is "lr"), whether the policy
    recomputes activations as its module says, the others as the step reads them."""
    values = {k: getattr(args, k) for k in sorted(flags_with("resume"))}
    values.update(weight_decay=engine.optimizer.param_groups[0]["weight_decay"],
                  gradient_checkpointing=engine.module.is_gradient_checkpointing)
    return {f"hparams/{k}": float(v) for k, v in values.items() if isinstance(v, (int, float))}


SUM_KEYS = ["pg_loss", "token_weight", "tokens", "clipped", "approx_kl", "grad_norm", "skipped_updates", "updates",
            "mismatch_abs", "mismatch_kl", "mismatch_out", "correction", "micro_batches"]


def step_metrics(rollouts: list[dict], sums: dict, reward_stats: dict, timer: dict, args, world: int,
                 model_flops, peak: float | None, memory: list[float] | None) -> dict[str, float]:
    """The step's metrics: this rank's sums reduced over ranks, then normalised.
    Rates are per device, the update's over the updates that ran (each response goes through one forward and
    backward)."""
    t_update, ran = max(timer["update"], 1e-9), bool(sums.get("updates"))
    local = {**rollout_metrics(rollouts, args.group_size), **dict.fromkeys(SUM_KEYS, 0.0), **sums,
             "timeouts": reward_stats.get("timeouts", 0), "errors": reward_stats.get("errors", 0),
             # the tokens this rank generated, before balance_ranks dealt some of its groups to another
             "gen_rate": reward_stats.get("generated", sum(r["length"] for r in rollouts))
             / max(timer["rollout"], 1e-9),
             "train_rate": sum(len(r["tokens"]) for r in rollouts) / t_update if ran else 0.0,
             "flop_rate": model_flops([len(r["tokens"]) for r in rollouts]) / t_update if ran else 0.0}
    local = dict(sorted(local.items()))  # the same keys in the same order on every rank
    tot = dict(zip(local, all_reduce(list(local.values())).tolist()))
    tokens, updates, n = max(1, tot["tokens"]), max(1, tot["updates"]), tot["responses"]
    metrics = {
        "reward/mean": tot["reward"] / n, "reward/accuracy": tot["correct"] / n,
        "loss/pg": tot["pg_loss"] / world / updates,  # each rank's loss is the mean over its own groups
        "loss/token_weight": tot["token_weight"] / world / updates,  # sum_i w_i L_i, loss/pg's scale
        "loss/clip_frac": tot["clipped"] / tokens, "loss/approx_kl": tot["approx_kl"] / tokens,
        "loss/grad_norm": tot["grad_norm"] / world / updates,
        "train/skipped_updates": tot["skipped_updates"],
        "train/micro_batches": tot["micro_batches"] / world / updates,  # per update and rank (every rank makes as many)
        "train/no_signal": float(tot["updates"] + tot["skipped_updates"] == 0),  # no mini-batch ran
        "length/mean": tot["length"] / n, "length/max": all_reduce([max(r["length"] for r in rollouts)], "max").item(),
        "length/cv": tot["length_cv"] / tot["groups"],
        "length/pos_neg_gap": tot["length_gap"] / tot["mixed_groups"] if tot["mixed_groups"] else 0.0,
        "groups/zero_var_share": tot["zero_var_groups"] / tot["groups"],
        "length/truncation_rate": tot["truncated"] / n,
        "reward/timeouts": tot["timeouts"], "reward/errors": tot["errors"],
        "perf/gen_tokens_per_s": tot["gen_rate"] / world, "perf/train_tokens_per_s": tot["train_rate"] / world,
        "perf/update_tflops": tot["flop_rate"] / world / 1e12,
        **{f"time/{k}": v for k, v in timer.items()},
    }
    if tot["tokens"]:  # measured on the tokens the update saw: none on a step without learning signal
        metrics.update({"rollout/mismatch_abs": tot["mismatch_abs"] / tokens, "rollout/mismatch_kl": tot[
            "mismatch_kl"] / tokens, "rollout/mismatch_out_share": tot["mismatch_out"] / tokens,
            "rollout/correction_mean": tot["correction"] / tokens})
    if "ref_kl" in tot:
        metrics["loss/ref_kl"] = tot["ref_kl"] / tokens
    if peak:
        metrics["perf/mfu"] = tot["flop_rate"] / world / peak
    if memory is not None:
        metrics["memory/update_peak_gib"], metrics["memory/device_used_gib"] = all_reduce(memory, "max").tolist()
    return metrics


def open_loggers(args, out_dir: Path, rank: int, start: int):
    """(log(step, metrics), close()): metrics.jsonl always, TensorBoard and/or wandb (--report-to); rank 0.

    The steps after `start` (the checkpoint resumed from) are redone: their metrics.jsonl lines are
    dropped and TensorBoard purges them; a fresh start (start 0) also redoes step 0's evaluation, so
    nothing logged is kept. wandb continues the run of the same id (out_dir/wandb_id), its charts
    against train/step, so a redone step is drawn again rather than rejected. TensorBoard is flushed
    at every step, so that an early end loses no step that metrics.jsonl holds.
    """
    if rank != 0:
        return (lambda step, metrics: None), (lambda: None)
    from torch.utils.tensorboard import SummaryWriter

    path = out_dir / "metrics.jsonl"
    logged = logged_lines(path)
    if start == 0 and any(step > 0 for step, _ in logged):
        print(f"[grpo] {out_dir} has logged steps but no checkpoint: starting afresh over them", flush=True)
    path.write_text("".join(line + "\n" for step, line in logged if 0 < start and step <= start))
    # TensorBoard drops the events of every step >= purge_step written before
    writer = SummaryWriter(str(out_dir / "tb"), purge_step=start + 1 if start else 0) \
        if "tensorboard" in args.report_to else None
    run = None
    if "wandb" in args.report_to:
        import wandb

        id_file = out_dir / "wandb_id"
        run_id = id_file.read_text().strip() if start > 0 and id_file.exists() else os.urandom(6).hex()
        id_file.write_text(run_id)
        try:
            run = wandb.init(project=os.environ.get("WANDB_PROJECT", "balanced-grpo"), name=out_dir.name, id=run_id,
                             resume="allow", config=vars(args), dir=str(out_dir))
        except Exception as e:  # wandb's own error types: no login, no network, a bad project
            sys.exit(f"train_grpo.py: error: --report-to wandb: {first_line(e)} (wandb login, or WANDB_MODE=offline)")
        run.define_metric("*", step_metric="train/step")

    def log(step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items() if writer else ():
            writer.add_scalar(k, v, step)
        if writer:
            writer.flush()
        if run is not None:
            run.log({"train/step": step, **metrics})
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close() -> None:
        if writer:
            writer.close()
        if run is not None:
            run.finish()

    return log, close
