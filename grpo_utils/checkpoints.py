"""Checkpoints: the full state (ZeRO-3 shards, random generators, the loop's state) and the HF export, the
damage checks that pick the newest checkpoint a run can resume from, and the reload."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path

import torch

from grpo_utils.common import FULL, first_line
from grpo_utils.engines import apply_optimizer_flags
from grpo_utils.flags import run_identity


def seed_rngs(seed: int) -> None:
    """Python's, NumPy's and torch's generators (--rollout-seed engine samples from NumPy's on CUDA, from
    torch's on the CPU)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


def save_checkpoint(engine, tokenizer, root: Path, step: int, trainer_state: dict, rank: int, keep_last: int,
                    weights: Iterable) -> None:
    """Full training state and a Hugging Face export in root/step_N, atomically.

    Everything goes to step_N.tmp first: every rank's ZeRO-3 model/optimizer/scheduler shards
    and RNG states (state/), the step and data position (trainer_state.json), and the HF
    export (config, safetensors, tokenizer) of `weights`, the (name, tensor) pairs of the policy
    gathered one at a time (train_grpo.policy_weights: under LoRA the merged weights, which load in
    plain transformers and vLLM). Only then does
    rank 0 rename it to step_N and point `latest` at it, so a kill at any moment leaves
    `latest` on a complete checkpoint. Full states beyond the last `keep_last` are deleted;
    the HF exports stay, for evaluating every checkpoint of a run.
    """
    import shutil

    import torch.distributed as dist

    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            tmp.mkdir(parents=True)
        dist.barrier()
        engine.save_checkpoint(str(tmp), tag="state", save_latest=False)
        torch.save(rng_state(), tmp / "state" / f"rng_rank{rank}.pt")
        exported = {}
        for name, tensor in weights:  # every rank walks them: each is a gather
            if rank == 0:
                exported[name] = tensor.detach().cpu().clone()
        if rank == 0:
            model = engine.module.get_base_model() if hasattr(engine.module, "get_base_model") else engine.module
            model.save_pretrained(tmp, state_dict=exported, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state))
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as "unexpected pos N vs M"
        if getattr(e, "errno", None) in FULL or no_space_left(root):
            raise OSError(errno.ENOSPC, f"no space left on {root}: {tmp.name} is incomplete (remove it, or "
                                        "the next save at this step does)") from None
        raise
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        (root / "latest.tmp").write_text(final.name)
        os.replace(root / "latest.tmp", root / "latest")
        states = [c for c in checkpoint_dirs(root) if (c / "state").is_dir()]
        for old in states[:-keep_last]:
            shutil.rmtree(old / "state", ignore_errors=True)
    dist.barrier()


def no_space_left(d: Path) -> bool:
    """Whether d's filesystem is full, or the user's quota spent: a 1 MiB write says it with an errno."""
    probe = d / f".space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        return False
    except OSError as e:
        return e.errno in FULL
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def checkpoint_dirs(root: Path) -> list[Path]:
    """The trainer's checkpoints in root, oldest first: step_ and digits only (step_best, a copy, and
    step_000001.bak, a backup, are the user's; step_N.tmp is a save in progress)."""
    found = [p for p in root.iterdir() if re.fullmatch(r"step_\d+", p.name) and p.is_dir()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[5:]))


def checkpoint_problem(ckpt: Path, world: int) -> str | None:
    """Why `world` ranks cannot resume from `ckpt`, or None when every file it needs is there."""
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if not isinstance(state, dict) or not {"step", "order", "bad_streak"} <= set(state):
            return "trainer_state.json lacks step / order / bad_streak"
    except (OSError, ValueError) as e:
        return f"trainer_state.json: {first_line(e)}"
    count = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
    if not count(state["step"]) or not count(state["bad_streak"]):
        return (f"trainer_state.json: step and bad_streak must be counts (got {state['step']!r}, "
                f"{state['bad_streak']!r})")
    if not isinstance(state["order"], list) or not all(map(count, state["order"])):
        return "trainer_state.json: order must be a list of prompt indices"
    if not isinstance(state.get("run", {}), dict):
        return "trainer_state.json: run must be the run's arguments"
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
    found = checkpoint_dirs(root)[::-1]
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


def release_optimizer_states(engine) -> None:
    """Drop Adam's moments before a load replaces them: torch's Optimizer.load_state_dict builds every state from
    the saved dict (copied to the device) before it lets the old go, so a reload after steps would hold the
    moments twice at its peak (8 B a trained parameter over the ranks). A swapping optimizer keeps its own."""
    zero = engine.optimizer
    if not getattr(zero, "swap_optimizer", False) and hasattr(zero, "optimizer"):
        zero.optimizer.state.clear()


def load_training_state(engine, ckpt: Path, rank: int, args) -> dict:
    """Model, optimizer, RNG and trainer state from `ckpt` (checked by damaged_shard first), under this launch's
    --lr, --weight-decay and --lr-warmup-steps (apply_optimizer_flags); a DeepSpeed config's own scheduler is
    restored as saved."""
    ours = engine.client_lr_scheduler is not None  # linear_warmup's: rebuilt from the flags, not loaded
    release_optimizer_states(engine)
    load_path, _ = engine.load_checkpoint(str(ckpt), tag="state", load_lr_scheduler_states=not ours)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint in {ckpt}/state")
    if ours or engine.lr_scheduler is None:
        apply_optimizer_flags(engine, args.lr, args.weight_decay, args.lr_warmup_steps * args.minibatches)
    set_rng_state(torch.load(ckpt / "state" / f"rng_rank{rank}.pt", weights_only=False))
    return json.loads((ckpt / "trainer_state.json").read_text())


def run_complete(checkpoints: list[Path], steps: int, out_dir: Path, rank: int) -> bool:
    """Whether the run already holds all `steps` (its newest checkpoint's step), said in one line by rank 0."""
    done = json.loads((checkpoints[0] / "trainer_state.json").read_text())["step"] if checkpoints else 0
    if done >= steps and rank == 0:
        print(f"[grpo] {out_dir} already holds all {steps} steps ({checkpoints[0].name}): nothing to do (raise "
              "--steps to train on, or pick another --output-dir)", flush=True)
    return done >= steps


def save_step(engine, tokenizer, out_dir: Path, step: int, order: list[int], bad_streak: int, args,
              sizes: dict, rank: int, weights: Iterable) -> None:
    """A checkpoint of `step` (save_checkpoint: the full state and the HF export) recording the data order left,
    the bad-step streak, the run's identity and the micro-batch sizes and device it was cut for (`sizes`); then
    args.json, the arguments that trained it, replaced whole (a kill mid-write leaves the old one)."""
    state = {"step": step, "order": order, "bad_streak": bad_streak, "run": run_identity(vars(args)), "sizes": sizes}
    save_checkpoint(engine, tokenizer, out_dir / "checkpoints", step, state, rank, args.keep_last, weights)
    if rank == 0:
        (out_dir / "args.json.tmp").write_text(json.dumps(vars(args), indent=1))
        os.replace(out_dir / "args.json.tmp", out_dir / "args.json")


def resume_point(out_dir: Path, world: int) -> str:
    """Where the same command picks the run up: its newest complete checkpoint, said in words."""
    ckpt = next((c for c in checkpoint_dirs(out_dir / "checkpoints")[::-1] if checkpoint_problem(c, world) is None),
                None)
    if ckpt is None:
        return "no checkpoint was saved yet: the same command starts the run afresh"
    return f"the same command resumes the run from {ckpt} (step {int(ckpt.name[5:])})"
