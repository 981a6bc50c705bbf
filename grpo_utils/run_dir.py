"""The run directory: one writer (run.lock), the one reader of args.json and metrics.jsonl, the check that a
launch continues the run it finds there, and the micro-batch sizes each checkpoint records for its device."""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch

from grpo_utils.checkpoints import resumable_checkpoints
from grpo_utils.common import first_line, writable_problem
from grpo_utils.flags import before_flag, flags_with, identity_changes, run_identity, shown_changes

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


def resumed_sizes(recorded: dict, this_device: dict, flags_given) -> tuple[dict, int | None]:
    """(the recorded sizes a resume applies, a cap on the token budget it measures anew) from a checkpoint's "sizes"
    (`recorded`, checked_sizes'; {} for none) and this launch's device_record (`here`). On the same device, vLLM
    holding the same share, and with no size flag given: the recorded sizes, so that a resumed --deterministic run
    cuts the same micro-batches. Otherwise none of them, and on CUDA the budget the run recorded caps the one
    measured at the first update: a budget that another device's or another share's memory gave may not fit here,
    and a larger one measured here is not taken over the record."""
    size_flags = flags_with("size")
    sizes = {k: v for k, v in recorded.items() if k in size_flags}
    same = all(recorded.get(k) == this_device.get(k) for k in SIZE_DEVICE_KEYS)
    if not recorded or (same and not size_flags & set(flags_given)):
        return sizes, None
    tokens = recorded.get("micro_batch_tokens")
    return {}, tokens if this_device.get("device") == "cuda" and isinstance(tokens, int) and tokens > 0 else None


def apply_recorded_sizes(batching: argparse.Namespace, flags_given: list[str], recorded: dict, this_device: dict,
                         checkpoint: Path | None, rank: int) -> int | None:
    """The micro-batch sizes `checkpoint` recorded, set in `batching` (micro_batching) where resumed_sizes reuses
    them (the run's own budget, not measured anew: --deterministic cuts the same micro-batches), said in one line;
    returns the cap on a budget measured anew (recorded on another device)."""
    sizes, budget_cap = resumed_sizes(recorded, this_device, flags_given)
    vars(batching).update(sizes)
    if rank == 0 and sizes:
        print("[grpo] micro-batches as the run recorded them: " + ", ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in sorted(sizes.items())), flush=True)
    elif rank == 0 and recorded and not flags_with("size") & set(flags_given):  # recorded on another device
        print(f"[grpo] {checkpoint.name} cut its micro-batches on {device_words(recorded)}, this launch runs on "
              f"{device_words(this_device)}: " + (f"the token budget is measured anew at the first update, at most "
                                                  f"the recorded {budget_cap} tokens" if budget_cap else
                                                  "sizes of its own"), flush=True)
    return budget_cap
