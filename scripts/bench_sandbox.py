"""Code-reward throughput of this checkout against another one, interleaved: does a change to the sandbox cost
scoring speed?

    python -m scripts.bench_sandbox --against /path/to/other/checkout            # HumanEval, 4 workers, 4 passes
    python -m scripts.bench_sandbox --against ../before --sets humaneval livecodebench_stdin --workers 2 4

Each pass scores every response of a set (data/reward_cases.code_cases: all of them pass) with compute_rewards in
a fresh process of each checkout, the two in turn (which goes first swaps every pass), so that the machine's load
falls on both alike. Prints responses/s per pass and the ratio of the medians (this checkout over the other).

    python -m scripts.bench_sandbox --contention --workers 4

measures instead the one signal the channel scan (tests/test_channel_scan.py) lets pass between sandboxes, CPU
contention: a reader sandbox counts its loop's rounds per window while writer sandboxes spin or sleep by a random
bit per window; prints the error rate and the bits/s a binary symmetric channel of that error rate carries.

    python -m scripts.bench_sandbox --scan-ablation     # the scan with each mask taken away, alone
    python -m scripts.bench_sandbox --check-cpu         # the scorer's CPU per check of the reference solutions
"""

from __future__ import annotations

import argparse
import inspect
import math
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # this checkout

ONE_PASS = """
import sys, time
from data.reward_cases import code_cases
from rewards import compute_rewards
responses, tests = code_cases(sys.argv[1])
n, workers = len(responses), int(sys.argv[2])
compute_rewards(responses[:workers], tests[:workers], ["code"] * workers, workers)  # workers up, sandbox probed
t = time.perf_counter()
scores = compute_rewards(responses, tests, ["code"] * n, workers)
rate = n / (time.perf_counter() - t)
assert scores == [1.0] * n, f"{scores.count(1.0)} of {n} passed"
print(rate)
"""


def one_pass(tree: Path, kind: str, workers: int) -> float:
    """Responses/s of one pass of `kind` at `workers`, scored by the checkout at `tree`."""
    res = subprocess.run([sys.executable, "-c", ONE_PASS, kind, str(workers)], cwd=tree, capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise SystemExit(f"bench_sandbox.py: error: {tree}: {(res.stderr or res.stdout).strip().splitlines()[-1:]}")
    return float(res.stdout.strip().splitlines()[-1])


# -- the time-only signal between sandboxes: CPU contention (tests/test_channel_scan.py declares it) ----------

def contention_writer(t0: float, window: float, bits: list[int], spinners: int) -> None:
    """`spinners` processes spin through the windows whose bit is 1 and sleep through the others."""
    import os
    import time

    for _ in range(spinners - 1):
        if os.fork() == 0:
            break
    for k, bit in enumerate(bits):
        end = t0 + (k + 1) * window
        if bit:
            while time.monotonic() < end:
                pass
        else:
            time.sleep(max(0.0, end - time.monotonic()))
    print("done")


def contention_reader(t0: float, window: float, n: int) -> None:
    """How much work this process gets done in each window (a count of loop rounds), printed."""
    import time

    counts = []
    time.sleep(max(0.0, t0 - time.monotonic()))
    for k in range(n):
        end, count = t0 + (k + 1) * window, 0
        while time.monotonic() < end:
            count += 1
        counts.append(count)
    print(counts)


def contention_capacity(window: float, n: int = 64, spinners: int = 16, writers: int = 1) -> tuple[float, float]:
    """(error rate, bits/s) of what a reader sandbox decodes from `writers` sandboxes' CPU use (responses of one
    group sending the same bits): n random bits, one per window, each read as 1 where the reader's rounds in it
    fall below their median; a binary symmetric channel of that error rate carries 1 - H(p) bits a window."""
    from sandboxed import sandbox

    bits = [random.getrandbits(1) for _ in range(n)]
    t0 = time.monotonic() + 1.5
    got = []
    threads = [threading.Thread(target=lambda: got.append(
        sandbox.run_sandboxed(_ship(contention_writer, t0, window, bits, spinners), timeout=n * window + 10)))
        for _ in range(writers)]
    for thread in threads:
        thread.start()
    rc, out, _ = sandbox.run_sandboxed(_ship(contention_reader, t0, window, n), timeout=n * window + 10)
    for thread in threads:
        thread.join()
    assert rc == 0 and all(w[1].startswith("done") for w in got), (out, got)
    counts = [int(x) for x in out.strip().strip("[]").split(",")]
    median = sorted(counts)[n // 2]
    p = sum((c < median) != bool(b) for c, b in zip(counts, bits)) / n
    p = min(p, 1 - p)
    entropy = 0.0 if p == 0 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    return p, (1 - entropy) / window

def _ship(fn, *args) -> str:
    return f"{inspect.getsource(fn)}\n{fn.__name__}(*{args!r})\n"



def contention(workers: list[int]) -> None:
    """The capacity at each window length, with 1 writer sandbox and with workers - 1 (a group's responses
    scored side by side, all but the reader sending the same bits)."""
    sys.path.insert(0, str(ROOT))
    from sandboxed import sandbox

    sandbox.sandbox_mode()
    for window in (0.005, 0.01, 0.02, 0.05, 0.1):
        for writers in sorted({1, *(max(1, w - 1) for w in workers)}):
            p, bits = contention_capacity(window, n=min(256, round(12.8 / window)), writers=writers)
            print(f"window {window * 1000:g} ms, {writers} writer sandbox(es) of 16 spinning processes: error rate "
                  f"{p:.3f}, {bits:.1f} bit/s", flush=True)


# What each of the round-3 masks hides: the filter's rules by system call (with `pipe` its sibling `pipe2`, and so
# on), and limit.hide_proc.
MASKS = (("hide_proc",), ("pipe", "pipe2"), ("socket", "socketpair"), ("memfd_create",), ("pidfd_open",), ("sysinfo",),
         ("setsid",), ("getsockopt",))


def scan_ablation() -> None:
    """tests/test_channel_scan.py's two scans, whole and with each mask taken away alone: how many numbers move
    with the writer, and where."""
    import collections

    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import test_channel_scan as scan

    from sandboxed import sandbox

    sandbox.sandbox_mode()
    rules = sandbox.seccomp_rules()
    for mask in ((), *MASKS):
        sandbox.HIDE_PROC = mask != ("hide_proc",)
        sandbox.seccomp_rules = lambda kept=tuple(r for r in rules if r[0] not in mask): kept
        found = {**scan.concurrent_scan(), **{"(later) " + k: v for k, v in scan.later_scan().items()}}
        where = collections.Counter(k.split(":")[0] for k in found).most_common(4)
        print(f"without {' and '.join(mask) or 'nothing'}: {len(found)} moving", *(f"{n} {w}" for w, n in where),
              sep="; ", flush=True)


def check_cpu() -> None:
    """The scorer's own CPU seconds (the check, the decoding, the sandbox's start and end) per HumanEval and MBPP
    reference solution, the function tests every benchmark copy holds a reference for."""
    import json
    import resource

    sys.path.insert(0, str(ROOT))
    import rewards
    from data.prepare import load_rows
    from data.reward_cases import BENCHMARKS

    rewards.sandbox_mode()
    refs = {json.loads(x)["task_id"]: json.loads(x) for name in ("humaneval.jsonl", "mbpp_sanitized.jsonl")
            for x in (BENCHMARKS / name).read_text().splitlines()}
    used = []
    for name, key in (("humaneval", lambda r: r["id"]), ("mbpp", lambda r: int(r["id"].split("/")[1]))):
        for row in load_rows(name, data_dir=str(BENCHMARKS)):
            ref = refs[key(row)]
            code = ref["prompt"] + ref["canonical_solution"] if name == "humaneval" else ref["code"]
            before = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
            passed = rewards.check_function(code, row["tests"])
            used.append((sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - before, passed, row["id"]))
    used.sort()
    print(f"{len(used)} reference solutions, {sum(p for _, p, _ in used)} passed; CPU s per check: median "
          f"{statistics.median(u for u, _, _ in used):.4f}, largest " +
          ", ".join(f"{u:.4f} ({i})" for u, _, i in used[-3:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", type=Path, help="the other checkout (e.g. a git worktree of main)")
    p.add_argument("--contention", action="store_true",
                   help="instead: the CPU-contention channel's capacity between sandboxes, bits/s per window length")
    p.add_argument("--scan-ablation", action="store_true",
                   help="instead: the channel scan with each of the sandbox's masks taken away alone")
    p.add_argument("--check-cpu", action="store_true",
                   help="instead: the scorer's CPU per check of the HumanEval and MBPP reference solutions")
    p.add_argument("--sets", nargs="+", default=["humaneval"], choices=["humaneval", "livecodebench_stdin"])
    p.add_argument("--workers", nargs="+", type=int, default=[4])
    p.add_argument("--passes", type=int, default=4)
    args = p.parse_args()
    for flag, values in (("--workers", args.workers), ("--passes", [args.passes])):
        if min(values) < 1:
            p.error(f"{flag} must be at least 1 (got {min(values)})")
    if args.contention:
        return contention(args.workers)
    if args.scan_ablation:
        return scan_ablation()
    if args.check_cpu:
        return check_cpu()
    if args.against is None:
        p.error("give --against (another checkout) or --contention")
    if not (args.against / "rewards.py").is_file():
        p.error(f"--against {args.against}: no rewards.py there (give the root of another checkout)")
    for kind in args.sets:
        for workers in args.workers:
            rates: dict[str, list[float]] = {"this": [], "other": []}
            for k in range(args.passes):
                order = [("this", ROOT), ("other", args.against)][:: 1 if k % 2 == 0 else -1]
                for name, tree in order:
                    rates[name].append(one_pass(tree, kind, workers))
            this, other = statistics.median(rates["this"]), statistics.median(rates["other"])
            print(f"{kind}, {workers} workers: this {' '.join(f'{r:.1f}' for r in rates['this'])} /s, other "
                  f"{' '.join(f'{r:.1f}' for r in rates['other'])} /s; medians {this:.1f} / {other:.1f} = "
                  f"{this / other:.3f}", flush=True)


if __name__ == "__main__":
    main()
