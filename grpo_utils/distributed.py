"""The ranks: the process group, the project's only two collectives (every other file goes through them),
early ends in one line (a rank that dies is named by its peers), and the loop's guards that stop every rank."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from grpo_utils.checkpoints import resume_point
from grpo_utils.common import FULL


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


def init_distributed(out_dir: Path, checkpoints: list[Path], world: int) -> tuple[int, int]:
    """Join the launcher's process group (NCCL on CUDA, gloo on the CPU); (rank, local rank).
    Every rank must see the same run: the output directory is shared between nodes."""
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


def free_port() -> int:
    """A port no process on this host listens on now, for a launch's rendezvous (two runs on one
    host would otherwise meet on the launcher's default 29500, and one rank join the other's run)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Collectives: NCCL serves CUDA tensors only ("No backend type associated with device type cpu"), gloo CPU
# tensors: every collective of the project goes through all_reduce and all_gather_objects, which put the data on
# the device the backend serves (tests/test_collectives.py enforces it).
def collective_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else torch.device("cpu")


def all_reduce(values, op: str = "sum") -> torch.Tensor:
    """A vector of numbers summed ("sum") or maximised ("max") over ranks; float64, on the CPU."""
    import torch.distributed as dist

    t = torch.as_tensor(values, dtype=torch.float64)
    if not dist.is_initialized():  # one process without a process group: a world of one
        return t.clone()
    t = t.to(collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.cpu()


def all_gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (NCCL: pickled through the current CUDA device)."""
    import torch.distributed as dist

    if not dist.is_initialized():  # one process without a process group: a world of one
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def exit_without_teardown(code: int = 0) -> None:
    """End the process now, past the interpreter's teardown of the engines (seconds per launch; gloo's
    can abort, "terminate called without an active exception"). Only once every file is closed and
    no rank is left in a collective with this one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# this launch's ranks, for ends_in_one_line to name one that died: each rank's (pid, host) in rank order, this
# rank, the run directory that holds their files (note_ranks), and the step under way (main's loop sets it)
LAUNCH: dict = {"ranks": [], "rank": None, "out_dir": None, "step": None}


# what a collective raises on a rank whose peer is gone: gloo's TCP pairs ("Connection closed by peer", "Connection
# reset by peer", a write's "Broken pipe"), NCCL's remote error
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ncclRemoteError|remote process exited")


def rank_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f".rank{rank}.pid"


ENDED = "ended\n"  # what a rank that ends on its own leaves in its file


def note_ranks(out_dir: Path, rank: int) -> None:
    """Every rank's (pid, host) (a collective), and this rank's file
    in the run directory, out_dir/.rankN.pid, which ends_in_one_line marks ENDED however the rank ends through
    it (and removes when the launch is done): a rank whose process is gone and whose file is not so marked died
    without a word (SIGKILL: the OOM killer; its file removed by hand too), and a survivor names it (dead_ranks).
    Written before the gather, so that every rank's is there after it."""
    rank_file(out_dir, rank).write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
    LAUNCH.update(ranks=[tuple(x) for x in all_gather_objects((os.getpid(), socket.gethostname()))], rank=rank,
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


def ends_in_one_line(output_dir: Callable[[list[str] | None], str]):
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


def nonfinite_weights(engine) -> int:
    """Non-finite weights over all ranks (each counts its own ZeRO-3 partition, no gather; one device sync)."""
    counts = [(~torch.isfinite(getattr(p, "ds_tensor", p))).sum() for p in engine.module.parameters()]
    return int(all_reduce([torch.stack(counts).sum().item()]).item())


def stop_on_nonfinite_weights(engine, step: int, metrics: dict, log: Callable, close_loggers: Callable,
                              out_dir: Path, world: int, rank: int) -> None:
    """Every rank stops where the step's update made any weight non-finite, its metrics logged: nothing of it is
    synced, evaluated or saved, and one line says where the run resumes from."""
    import torch.distributed as dist

    if nonfinite := nonfinite_weights(engine):
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
