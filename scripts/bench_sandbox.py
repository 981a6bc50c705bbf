"""Code-reward throughput of this checkout against another one, interleaved: does a change to the sandbox cost
scoring speed?

    python -m scripts.bench_sandbox --against /path/to/other/checkout            # HumanEval, 4 workers, 4 passes
    python -m scripts.bench_sandbox --against ../before --sets humaneval livecodebench_stdin --workers 2 4

Each pass scores every response of a set (data/reward_cases.code_cases: all of them pass) with compute_rewards in
a fresh process of each checkout, the two in turn (which goes first swaps every pass), so that the machine's load
falls on both alike. Prints responses/s per pass and the ratio of the medians (this checkout over the other).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, type=Path, help="the other checkout (e.g. a git worktree of main)")
    p.add_argument("--sets", nargs="+", default=["humaneval"], choices=["humaneval", "livecodebench_stdin"])
    p.add_argument("--workers", nargs="+", type=int, default=[4])
    p.add_argument("--passes", type=int, default=4)
    args = p.parse_args()
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
