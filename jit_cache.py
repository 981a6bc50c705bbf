"""DeepSpeed's JIT-built ops (ninja, into TORCH_EXTENSIONS_DIR): a folder per install, no stale build
lock, a writable cache, a build about to run said in one line. Plumbing for train_grpo.py's start."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from grpo_run import writable_problem


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
    """The DeepSpeed ops this launch JIT-builds (ninja, into TORCH_EXTENSIONS_DIR) on first use: the CPU
    collectives on the CPU, CPU Adam with optimizer offload, FusedAdam when torch's AdamW is not chosen."""
    ops = [] if torch.cuda.is_available() else ["deepspeed_shm_comm"]
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
            print(f"[grpo] building DeepSpeed's {op} op into {root / op} (once per install: about 20 s on a CPU, "
                  "minutes with nvcc)", flush=True)
