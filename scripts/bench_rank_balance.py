"""Per-rank tokens of a GRPO mini-batch, dealt as sampled (each rank its own contiguous groups) and by
batching.balanced_deal: the max / mean that sets every step's pace (the slowest rank waits for none).

    python -m scripts.bench_rank_balance [--ranks 8] [--groups 32] [--group-size 16] [--trials 200]

Response lengths are GRPO-like: a lognormal body of mean ~3k tokens, capped at 8k (the truncated tail), and
within a group correlated through the prompt's difficulty. No engine runs: only the dealing is measured.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo_utils.batching import balanced_deal  # noqa: E402

CAP = 8192


def grpo_lengths(rng: random.Random, group_size: int, mean: float = 3000.0, cap: int = CAP) -> list[int]:
    """One group's response lengths: the prompt sets a scale (hard prompts ramble), each response varies about it."""
    scale = mean * math.exp(rng.gauss(0, 0.5) - 0.125)
    return [min(cap, max(16, int(scale * math.exp(rng.gauss(0, 0.6) - 0.18)))) for _ in range(group_size)]


def contiguous_loads(groups: list[int], world: int) -> list[int]:
    per = len(groups) // world
    return [sum(groups[r * per : (r + 1) * per]) for r in range(world)]


def lower_bound(groups: list[int], world: int) -> float:
    """No dealing of whole groups, as many to each rank, does better than this max / mean: the largest group with
    the smallest others a rank needs beside it."""
    per, small = len(groups) // world, sorted(groups)
    return max(sum(groups) / world, max(groups) + sum(small[: per - 1])) * world / sum(groups)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--groups", type=int, default=32, help="a mini-batch's (the paper: 512 prompts, 16 mini-batches)")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for flag, low in (("ranks", 1), ("groups", 1), ("group_size", 2), ("trials", 1), ("seed", 0)):
        if getattr(a, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be at least {low} (got {getattr(a, flag)})")
    if a.groups % a.ranks:  # every rank deals as many whole groups
        p.error(f"--groups {a.groups} must be a multiple of --ranks {a.ranks}")
    rng = random.Random(a.seed)
    before, after, bound, tokens = [], [], [], []
    for _ in range(a.trials):
        groups = [sum(grpo_lengths(rng, a.group_size)) for _ in range(a.groups)]
        tokens.append(sum(groups))
        spread = lambda loads: max(loads) * len(loads) / sum(loads)  # noqa: E731
        before.append(spread(contiguous_loads(groups, a.ranks)))
        after.append(spread([sum(groups[g] for g in part) for part in balanced_deal(groups, a.ranks)]))
        bound.append(lower_bound(groups, a.ranks))
    print(f"[rank balance] {a.trials} mini-batches of {a.groups} groups x {a.group_size} responses on {a.ranks} ranks "
          f"({statistics.mean(tokens) / a.ranks / 1e3:.0f}k tokens a rank on average)")
    for name, xs in (("as sampled", before), ("balanced_deal", after)):
        print(f"[rank balance] {name:>13}: max / mean of per-rank tokens {statistics.mean(xs):.3f} on average, "
              f"{max(xs):.3f} at worst")
    met = sum(x <= 1.05 for x in after)
    reachable = sum(b <= 1.05 for b in bound)
    print(f"[rank balance] goal max / mean <= 1.05: met in {met} of {a.trials} mini-batches "
          f"({reachable} allow it: the largest group and the smallest beside it bound the rest); on average "
          f"{statistics.mean(after):.3f} against {statistics.mean(before):.3f} as sampled "
          f"(ratio {statistics.mean(before) / statistics.mean(after):.3f})")


if __name__ == "__main__":
    main()
