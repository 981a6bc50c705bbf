"""Table 1's own measure at lab scale: held-out Acc@8 and Best@8 of seq, token and balanced at the peak and at the
last checkpoint, with seeds (docs/lab.md, "Table 1's measure at lab scale"). Design, prediction and this analysis
were committed before any of the study's runs.

    python -m scripts.heldout_study --design        # before any run: the power analysis behind SEEDS
    python -m scripts.heldout_study runs/heldout    # after: the per-seed table and the declared tests

The design. seq, token and balanced (Table 1's three rules) on two offline lab tasks that differ only in how long a
failed loop is: COUPLED, where failures are ~3.5x as long as successes (the sign-length coupling token-agg suffers),
and CONTROL, where they are as long (no coupling: token and balanced weigh a group alike). Every (task, rule) cell
runs every seed in SEEDS; a seed fixes the prompts of every step and step 1's sampling, so the cells pair by seed.
Each run saves an export every 5 of its 30 steps; every export is scored on the task's 200 held-out prompts
exactly, from the policy's probability p_i of a right answer to prompt i (summed over the task's right responses):

    Acc@k  = 100 mean_i p_i                  (the expectation of the sampled Acc@k, whatever k)
    Best@k = 100 mean_i (1 - (1 - p_i)^k)    (the expectation of the sampled Best@k, pass@k), k = 8

so the measure carries the runs' variation alone, none of the evaluation's sampling. A run's peak is a measure's
largest value over its exports (steps 5-30, the initial policy left out: every arm shares it), as Table 1 takes
its peak; its last is the value at step 30. The peak is chosen on the held-out prompts themselves, as the paper's
is: it is biased upward, alike for every rule.

The declared tests, per seed s: d(s) = M(balanced, s) - M(other, s), positive where balanced is ahead, as Table 1
has it at the peak. Two-sided paired t-tests (n - 1 degrees of freedom), alpha 0.05, 95% CIs, and TOST against
+-MARGIN points so that "no difference" is a result the study can reach (equivalence where its p < 0.05).
Primary (Holm over the four, for the t-tests and, apart, for TOST): on COUPLED, Acc@8, balanced - token and
balanced - seq, at the peak and at the last checkpoint. Secondary (Holm over the eight): the same four on COUPLED's
Best@8 and on CONTROL's Acc@8. Anything else the tables show (CONTROL's Best@8, seq - token, the ordering of
the three means) is descriptive and says "(not tested)" where it is read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from scripts.compare_rules import GAPS, holm, p_text, paired, paired_curves, run_table, t_quantile

TASKS = {"coupled": GAPS["long"], "control": GAPS["none"]}
RULES = ("seq", "token", "balanced")
REFERENCE = "balanced"
K = 8
SEEDS = list(range(33, 54))  # 21 seeds no earlier experiment ran (the LoRA study's ended at 32): design() says why
FLAGS = ["--steps", "30", "--save-interval", "5", "--max-response-len", "96"]  # the factorial's, 6 exports a run
# the study's runs, one ablation.py command a task (scripts/reproduce.py trains them once the study is run)
ABLATIONS = [["--model", task, "--aggs", *RULES, "--seeds", *map(str, SEEDS), "--no-eval", "--out", "runs/heldout",
              "--", *FLAGS] for task in TASKS.values()]
MARGIN = 1.0  # Acc@8 and Best@8 points: the factorial's declared margin for held-out J
ALPHA, POWER = 0.05, 0.8
PRIMARY = [("coupled", "Acc@8", point, other) for point in ("peak", "last") for other in ("token", "seq")]
SECONDARY = [(task, m, point, other) for task, m in (("coupled", "Best@8"), ("control", "Acc@8"))
             for point in ("peak", "last") for other in ("token", "seq")]

# The spread the power analysis plans for: the factorial's held-out J at the last checkpoint, token - balanced per
# seed (results.md, factorial, "| J | long |" and "| J | none |"; tests/test_heldout_study.py holds them to it),
# the only paired held-out differences of these tasks on record; the effect planned for is the long gap's mean
# deficit there.
FACTORIAL_J = {"long": [-2.0, -0.6, 0.3, -1.1, -1.1, -0.1, -0.9, -1.6, -1.6, -1.3, -2.8, 1.6],
               "none": [0.1, 0.2, 1.7, -0.2, 0.5, -1.2, -0.0, -0.9, 0.6, -0.8, 0.7, -1.1]}


# -----------------------------------------------------------------------------
# The power analysis (before any run)


def _chi2_density(v: float, df: int) -> float:
    import mpmath

    return float(mpmath.exp((df / 2 - 1) * mpmath.log(v) - v / 2 - (df / 2) * mpmath.log(2) - mpmath.loggamma(df / 2)))


def power_t(n: int, effect: float, sd: float, alpha: float) -> float:
    """Power of the two-sided paired t-test at level alpha with n pairs, when the differences are N(effect, sd^2):
    P(|T| > t_crit) for T noncentral t(n - 1, effect sqrt(n) / sd), integrated over the sample variance."""
    import mpmath

    df, ncp = n - 1, effect * n**0.5 / sd
    c = t_quantile(1 - alpha / 2, df)
    phi = lambda x: float(mpmath.ncdf(x))

    def given(v):  # v = df s^2 / sd^2 ~ chi^2(df): reject where |z + ncp| > c sqrt(v / df)
        r = c * (float(v) / df) ** 0.5
        return (1 - phi(r - ncp) + phi(-r - ncp)) * _chi2_density(float(v), df)

    return float(mpmath.quad(given, [0, df, mpmath.inf]))


def power_tost(n: int, margin: float, sd: float, alpha: float, true: float = 0.0) -> float:
    """Power of TOST (both one-sided tests at alpha) with n pairs against +-margin, when the differences are
    N(true, sd^2): P(-margin + t_c se < mean < margin - t_c se), integrated over the sample variance."""
    import mpmath

    df = n - 1
    c = t_quantile(1 - alpha, df)
    phi = lambda x: float(mpmath.ncdf(x))

    def given(v):  # se = sd sqrt(v / df) / sqrt(n); mean ~ N(true, sd^2 / n)
        half = (margin - c * sd * (float(v) / df) ** 0.5 / n**0.5) / (sd / n**0.5)
        if half <= 0:
            return 0.0
        shift = true / (sd / n**0.5)
        return (phi(half - shift) - phi(-half - shift)) * _chi2_density(float(v), df)

    return float(mpmath.quad(given, [0, df, mpmath.inf]))


def seeds_needed(power: Callable[[int], float], target: float = POWER, most: int = 200) -> int:
    """The fewest pairs n >= 3 at which power(n) reaches target."""
    for n in range(3, most + 1):
        if power(n) >= target:
            return n
    raise ValueError(f"more than {most} pairs would be needed")


def sd(x: list[float]) -> float:
    m = sum(x) / len(x)
    return (sum((v - m) ** 2 for v in x) / (len(x) - 1)) ** 0.5


def largest_sd(power: Callable[[float], float], target: float = POWER) -> float:
    """The largest spread at which power(sd) still reaches target (power falls as sd grows), by bisection."""
    lo, hi = 0.01, 10.0
    for _ in range(20):  # 10 / 2^20: far below the printed 0.01
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(mid) >= target else (lo, mid)
    return lo


def design() -> str:
    """The power analysis as markdown: at each task's spread on record, the seeds each primary test needs and its
    power at len(SEEDS); the level planned for is Holm's first step (alpha / 4), the strictest any of the four
    meets; then the largest spread at which len(SEEDS) keeps power 0.8."""
    level, n = ALPHA / len(PRIMARY), len(SEEDS)
    spreads = {gap: sd(v) for gap, v in FACTORIAL_J.items()}
    effect = -sum(FACTORIAL_J["long"]) / len(FACTORIAL_J["long"])
    lines = [f"Held-out study design: {', '.join(RULES)} x {', '.join(f'{k} ({v})' for k, v in TASKS.items())}, "
             f"{n} paired seeds ({SEEDS[0]}-{SEEDS[-1]}), {len(RULES) * len(TASKS) * n} runs ({' '.join(FLAGS)}). "
             f"Planned spread: the sd of the factorial's held-out J difference token - balanced per seed, 12 seeds "
             f"(long gap {spreads['long']:.2f}, no gap {spreads['none']:.2f} points); planned effect "
             f"{effect:.2f} points (the long gap's mean deficit there); level {level:.4f} (alpha {ALPHA} / "
             f"{len(PRIMARY)}, Holm's first step); target power {POWER}\n",
             f"| test | sd | effect or margin | seeds for power {POWER} | power at {n} seeds |",
             "|---|---|---|---|---|"]
    for name, s in (("long gap", spreads["long"]), ("no gap", spreads["none"])):
        t = lambda k, s=s: power_t(k, effect, s, level)
        e = lambda k, s=s: power_tost(k, MARGIN, s, level)
        lines.append(f"| t-test, d = {effect:.2f} ({name} sd) | {s:.2f} | {effect:.2f} | {seeds_needed(t)} | "
                     f"{t(n):.2f} |")
        lines.append(f"| TOST, d = 0 ({name} sd) | {s:.2f} | ± {MARGIN} | {seeds_needed(e)} | {e(n):.2f} |")
    t_sd = largest_sd(lambda s: power_t(n, effect, s, level))
    e_sd = largest_sd(lambda s: power_tost(n, MARGIN, s, level))
    lines.append(f"\nAt {n} seeds power stays at {POWER} or above up to an sd of {t_sd:.2f} points for the t-test "
                 f"(d = {effect:.2f}) and {e_sd:.2f} for TOST (d = 0, ± {MARGIN}).")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# The measure


def at_k(p: list[float], k: int = K) -> dict[str, float]:
    """Acc@k and Best@k (%) from the per-prompt probabilities of a right answer: their expectations, exact."""
    p = [min(1.0, max(0.0, x)) for x in p]  # a sum of exact probabilities, up to rounding
    return {f"Acc@{k}": 100 * sum(p) / len(p), f"Best@{k}": 100 * sum(1 - (1 - x) ** k for x in p) / len(p)}


def prompt_probabilities(ckpt: str, task: str) -> list[float]:
    """p_i of an export on the task's held-out prompts, computed once and kept beside it (heldout.json)."""
    cache = Path(ckpt, "heldout.json")
    kept = json.loads(cache.read_text()) if cache.is_file() else {}
    if task not in kept:
        from scripts.compare_rules import checkpoint_decisions

        kept[task] = checkpoint_decisions(ckpt, task)["per_prompt"]
        cache.write_text(json.dumps(kept))
    return kept[task]


def exports(run: Path) -> list[tuple[int, str]]:
    """(step, export) of the run's checkpoints, the initial policy left out."""
    from evaluate import run_checkpoints

    return [(s, c) for s, c in run_checkpoints(str(run)) if s > 0]


# -----------------------------------------------------------------------------
# The analysis (after the runs)


def heldout_study(runs_dir: Path, probabilities=prompt_probabilities, checkpoints=exports) -> str:
    """The study's report as markdown: per task, rule and seed Acc@8 and Best@8 at the peak and the last export;
    then the declared tests (PRIMARY, SECONDARY) on d = balanced - other per seed."""
    values: dict[tuple[str, str, str, str, int], float] = {}  # (task, rule, measure, point, seed)
    seeds_of, steps_of = {}, {}
    for key, task in TASKS.items():
        table = run_table(runs_dir, task, list(RULES))
        for a in RULES:
            if a not in table:
                raise ValueError(f"{runs_dir}: no {a} run on {task} (every cell runs every seed)")
        seeds = sorted(set().union(*(set(table[a]) for a in RULES)))
        for a in RULES:  # every cell runs every seed: none is dropped from the tests unsaid
            if missing := [s for s in seeds if s not in table[a]]:
                raise ValueError(f"{runs_dir}: {task}: no {a} run of seed {missing[0]} (every cell runs every "
                                 "seed; the same ablation.py command trains it)")
        paired_curves(runs_dir, table, list(RULES))  # finished, of one length, paired at step 1
        seeds_of[key] = seeds
        for a in RULES:
            for s in seeds:
                saved = checkpoints(table[a][s])
                steps_of[(key, a, s)] = tuple(step for step, _ in saved)
                if not saved:
                    raise ValueError(f"{table[a][s]}: no exports (the study saves every 5 steps: {' '.join(FLAGS)})")
                scores = [at_k(probabilities(c, task)) for _, c in saved]
                for m in scores[0]:
                    values[(key, a, m, "peak", s)] = max(x[m] for x in scores)
                    values[(key, a, m, "last", s)] = scores[-1][m]
    if len(set(steps_of.values())) != 1:
        raise ValueError(f"{runs_dir}: the runs' exports are at different steps "
                         f"({sorted(set(steps_of.values()))}); train every run with {' '.join(FLAGS)}")
    if seeds_of["coupled"] != seeds_of["control"]:
        raise ValueError(f"{runs_dir}: the tasks ran different seeds ({seeds_of['coupled']} and "
                         f"{seeds_of['control']}); every cell runs every seed")
    seeds = seeds_of["coupled"]
    from scripts.length_drift import mean_std as ms

    measures = [f"Acc@{K}", f"Best@{K}"]
    lines = [f"Held-out study: {', '.join(RULES)} x {', '.join(f'{k} ({v})' for k, v in TASKS.items())}, "
             f"{len(seeds)} paired seeds ({', '.join(map(str, seeds))}), exports at steps "
             f"{', '.join(map(str, steps_of.popitem()[1]))}; Acc@{K} and Best@{K} (%) on the 200 held-out prompts, "
             "exact expectations; peak = the largest over the exports, last = the last export\n",
             "| task | rule | " + " | ".join(f"{m} {pt}" for m in measures for pt in ("peak", "last")) + " |",
             "|---|---|" + "---|" * 4]
    for key in TASKS:
        for a in RULES:
            cells = [ms([values[(key, a, m, pt, s)] for s in seeds]) for m in measures for pt in ("peak", "last")]
            lines.append(f"| {key} | {a} | " + " | ".join(cells) + " |")
    lines += ["", "Per seed: Acc@8 and Best@8 at the peak / last export\n",
              "| task | rule | seed | Acc@8 peak / last | Best@8 peak / last |", "|---|---|---|---|---|"]
    for key in TASKS:
        for a in RULES:
            for s in seeds:
                lines.append(f"| {key} | {a} | {s} | " + " | ".join(
                    f"{values[(key, a, m, 'peak', s)]:.1f} / {values[(key, a, m, 'last', s)]:.1f}" for m in measures)
                    + " |")
    diffs = {c: [values[(c[0], REFERENCE, c[1], c[2], s)] - values[(c[0], c[3], c[1], c[2], s)] for s in seeds]
             for c in PRIMARY + SECONDARY}
    tests = {c: paired(d, MARGIN) for c, d in diffs.items()}
    p_adj = dict(zip(PRIMARY, holm([tests[c]["p"] for c in PRIMARY]), strict=True))
    p_adj.update(zip(SECONDARY, holm([tests[c]["p"] for c in SECONDARY]), strict=True))
    tost = dict(zip(PRIMARY, holm([tests[c]["p_tost"] for c in PRIMARY]), strict=True))
    lines += ["", f"The declared tests: d = {REFERENCE} - other per seed; two-sided paired t-tests, alpha {ALPHA}, "
              f"95% CIs; primary: the four on coupled's Acc@8 (p Holm-adjusted over them; TOST against ± {MARGIN} "
              "points, its p Holm-adjusted over them apart, equivalence where it is below 0.05); secondary: the "
              "eight others (p Holm-adjusted over them)\n",
              "| family | task | measure | point | contrast | d per seed | mean d | 95% CI | d_z | t | p | TOST p |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in PRIMARY + SECONDARY:
        r, (key, m, pt, other) = tests[c], c
        lines.append(f"| {'primary' if c in PRIMARY else 'secondary'} | {key} | {m} | {pt} | {REFERENCE} - {other} | "
                     f"{' '.join(f'{v:+.1f}' for v in diffs[c])} | {r['mean']:+.2f} | [{r['lo']:+.2f}, "
                     f"{r['hi']:+.2f}] | {r['dz']:+.2f} | {r['t']:+.2f} | {p_text(p_adj[c])} (Holm) | "
                     + (f"{p_text(tost[c])} (Holm) |" if c in tost else "- |"))
    # the power each primary test had: at the planned effect and margin, with the spread these seeds realised
    level, effect = ALPHA / len(PRIMARY), -sum(FACTORIAL_J["long"]) / len(FACTORIAL_J["long"])
    lines += ["", f"Power of the primary tests at the spread realised (level {level:.4f}, Holm's first step), against "
              f"the planned effect {effect:.2f} (t-test) and a true 0 (TOST, ± {MARGIN})\n",
              "| point | contrast | sd of d | t-test power | TOST power |", "|---|---|---|---|---|"]
    for c in PRIMARY:
        s, n = tests[c]["sd"], len(seeds)
        t_power, e_power = (power_t(n, effect, s, level), power_tost(n, MARGIN, s, level)) if s > 0 else (1.0, 1.0)
        lines.append(f"| {c[2]} | {REFERENCE} - {c[3]} | {s:.2f} | {t_power:.2f} | {e_power:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="?", help="the study's ablation.py --out directory (both tasks' runs)")
    p.add_argument("--design", action="store_true", help="the power analysis behind the seeds (no runs needed)")
    a = p.parse_args(argv)
    if a.design == bool(a.runs):
        p.error("give one of: --design, or the study's runs directory")
    try:
        print(design() if a.design else heldout_study(Path(a.runs)))
    except ValueError as e:
        sys.exit(f"heldout_study: {e}")


if __name__ == "__main__":
    main()
