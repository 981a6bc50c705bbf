"""The engines' settings: DeepSpeed's configuration (the file's optimizer and ZeRO-3 settings with the flags'
sizes, lr and precision), the warm-up, vLLM's CPU arguments, and DeepSpeed's JIT-built ops (a folder per
install, no stale build lock, a writable cache, a build about to run said in one line)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from grpo_utils.common import first_line, writable_problem


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
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage != 3:  # a resume checks and loads ZeRO-3's layout: a model and an optimizer shard per rank
        raise ValueError(f"--ds-config {args.ds_config}: ZeRO stage {stage}; this trainer runs ZeRO-3 only "
                         "(set zero_optimization.stage to 3; offload options stay available)")
    per_rank = args.prompts_per_step // world * args.group_size // args.minibatches
    micro = args.micro_batch_size or 1  # DeepSpeed's bookkeeping only: update_minibatch sets each boundary
    gas = math.ceil(per_rank / micro)
    sizes = dict(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas,
                 train_batch_size=micro * gas * world)
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


def warmup_factor(done: int, num_updates: int) -> float:
    """min(1, k / num_updates) for the k-th optimizer update (k = done + 1): the first update already moves the
    weights (DeepSpeed's WarmupLR gives it lr 0); 1 without warm-up."""
    return min(1.0, (done + 1) / num_updates) if num_updates > 0 else 1.0


def linear_warmup(num_updates: int):
    """lr x warmup_factor, stepped once per optimizer update that is applied."""
    from torch.optim.lr_scheduler import LambdaLR

    return lambda optimizer: LambdaLR(optimizer, lambda done: warmup_factor(done, num_updates))


def apply_optimizer_flags(engine, lr: float, weight_decay: float, warmup_updates: int) -> None:
    """A resumed optimizer under this launch's flags: its saved state holds the rate, weight decay and schedule
    it was saved with, which --resume may change. The schedule's position is the updates applied so far
    (DeepSpeed's global steps less those it skipped, which its scheduler does not count either)."""
    done = engine.global_steps - engine.skipped_steps
    groups = engine.optimizer.param_groups
    for group in groups:
        group.update(lr=lr * warmup_factor(done, warmup_updates), initial_lr=lr, weight_decay=weight_decay)
    if (schedule := engine.lr_scheduler) is not None:
        schedule.base_lrs, schedule.last_epoch = [lr] * len(groups), done
        schedule._last_lr = [group["lr"] for group in groups]


def vllm_cpu_kwargs(max_model_len: int) -> dict:
    # vLLM's CPU sampler cannot rewind a seeded request's generator when chunked prefill splits
    # its prompt ("CPU Generator does not use offset"), which happens as soon as a batch's prompt
    # tokens exceed the token budget. Prefill whole prompts instead, with a budget that holds
    # the longest (vLLM's CPU platform does the same for MLA models).
    return dict(dtype="float32", enforce_eager=True, enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_model_len, 4096))


def jit_extensions_dir() -> str:
    """Where DeepSpeed's JIT-built ops go: torch's cache root, in a folder of its own per install of
    DeepSpeed and torch. torch rebuilds an op whenever the build.ninja it finds names other source paths,
    and each clone's venv holds them at other paths: with one shared folder, launches from two clones
    rebuilt each other's ops in turn (84-177 s, silently)."""
    import importlib.util

    from torch.utils.cpp_extension import get_default_build_root

    spec = importlib.util.find_spec("deepspeed")
    install = f"{spec.origin if spec else ''}\n{torch.__file__}"
    device = f"rocm{torch.version.hip}" if torch.version.hip else f"cu{torch.version.cuda}" if torch.version.cuda \
        else "cpu"
    name = f"py{sys.version_info.major}{sys.version_info.minor}_{device.replace('.', '')}"
    return os.path.join(get_default_build_root(), f"{name}-{hashlib.sha1(install.encode()).hexdigest()[:8]}")


def jit_ops(ds_config: dict) -> list[str]:
    """The DeepSpeed ops this launch JIT-builds (ninja, into TORCH_EXTENSIONS_DIR) on first use: CPU Adam with
    optimizer offload, FusedAdam when torch's AdamW is not chosen (the CPU's collectives: start_deepspeed_comm)."""
    ops = []
    optimizer = ds_config.get("optimizer", {})
    if ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none":
        ops.append("cpu_adam")
    elif optimizer.get("type", "").lower() in ("adam", "adamw") and not optimizer.get("params", {}).get("torch_adam"):
        ops.append("fused_adam")
    return ops


LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "jfs", "bcachefs"}


def on_local_filesystem(path: Path) -> bool:
    """Whether `path` lies on a filesystem no other machine writes to (its mount in /proc/mounts)."""
    target, best, kind = os.path.realpath(path), "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            mount, fstype = line.split()[1:3]
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind in LOCAL_FILESYSTEMS


def lock_holders(path: Path) -> list[int] | None:
    """This machine's processes that hold `path` open (/proc/PID/fd), or None where /proc cannot tell."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target, holders = os.path.realpath(path), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # a process that ended meanwhile, or another user's
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                holders.append(int(pid))
    return holders


def clear_stale_build_lock(lock: Path, speak: bool, wait_s: float = 900) -> None:
    """torch's JIT build lock (a file that its builder holds open and removes when done) left by a launch
    killed while it built makes every later build of the op wait for it forever, saying nothing. On a
    local filesystem with no process holding it, its builder is gone: it is removed. Where another
    machine may be building into a shared cache, it is waited for (wait_s), then named."""
    if not lock.exists():
        return
    holders = lock_holders(lock)
    if holders:
        return  # a build is running on this machine: torch waits for it, as it should
    if holders is not None and on_local_filesystem(lock):
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            if speak:
                print(f"[grpo] removed {lock}: a JIT build lock whose builder is gone (a launch killed while it "
                      "built)", flush=True)
        return
    if speak:
        print(f"[grpo] waiting for {lock}: a JIT build lock held by no process on this machine (another node "
              "building into a shared cache?)", flush=True)
    deadline = time.time() + wait_s
    while lock.exists() and time.time() < deadline:
        time.sleep(1)
    if lock.exists():
        raise ValueError(f"{lock}: a JIT build lock held by no process on this machine for {wait_s:.0f} s, left by "
                         f"a launch killed while it built; if no other node builds into this cache, rm {lock}")


def check_jit_cache(ds_config: dict, local_rank: int) -> None:
    """The ops this launch JIT-builds can be built: TORCH_EXTENSIONS_DIR is writable (torch takes a build
    lock there even to load a built op) and holds no stale build lock; a build about to run is said."""
    import importlib.util

    ops = jit_ops(ds_config)
    if not ops:
        return
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or jit_extensions_dir())
    if problem := writable_problem(root):
        raise ValueError(f"the JIT extension cache {root} is not writable ({problem}); set TORCH_EXTENSIONS_DIR "
                         "to a writable directory")
    spec = importlib.util.find_spec("deepspeed")
    source = os.path.dirname(spec.origin) if spec and spec.origin else ""
    for op in ops:
        clear_stale_build_lock(root / op / "lock", speak=local_rank == 0)
        ninja = root / op / "build.ninja"
        built = any((root / op).glob("*.so")) and ninja.exists() and source in ninja.read_text()
        if not built and local_rank == 0:
            print(f"[grpo] building DeepSpeed's {op} op into {root / op} (once per install: a minute or more)",
                  flush=True)
