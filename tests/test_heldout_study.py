"""heldout_study.py, the pre-registered study of Table 1's measure: the power analysis against a simulation, the
planned spread against the factorial's record, the exact Acc@k and Best@k against their definitions, and the report
on runs written the way the trainer writes them."""

import json
import math
import random

import pytest
from conftest import ROOT

from scripts import heldout_study as H
from scripts.compare_rules import holm, paired, t_quantile


def simulated_power(n: int, mean: float, sd: float, reject, trials: int = 4000, seed: int = 0) -> float:
    """The fraction of simulated paired samples (n differences from N(mean, sd^2)) that `reject` rejects, given
    each sample's mean and standard error."""
    rng = random.Random(seed)
    hits = 0
    for _ in range(trials):
        d = [rng.gauss(mean, sd) for _ in range(n)]
        m = sum(d) / n
        hits += reject(m, (sum((x - m) ** 2 for x in d) / (n - 1) / n) ** 0.5)
    return hits / trials


# 4000 trials: the simulated fraction's standard error is at most 0.008; 0.03 is over 3.5 of them
@pytest.mark.parametrize("n,effect,sd,alpha", [(8, 1.0, 1.2, 0.05), (12, 0.6, 1.0, 0.0125)])
def test_the_t_tests_power_is_the_rejection_rate_of_simulated_samples(n, effect, sd, alpha):
    c = t_quantile(1 - alpha / 2, n - 1)
    want = simulated_power(n, effect, sd, lambda m, se: abs(m / se) > c)
    assert abs(H.power_t(n, effect, sd, alpha) - want) < 0.03


@pytest.mark.parametrize("n,margin,sd,alpha", [(10, 1.0, 1.0, 0.05), (16, 1.0, 1.15, 0.0125)])
def test_tosts_power_is_the_rejection_rate_of_simulated_samples(n, margin, sd, alpha):
    c = t_quantile(1 - alpha, n - 1)  # both one-sided tests reject at alpha
    want = simulated_power(n, 0.0, sd, lambda m, se: (m + margin) / se > c and (m - margin) / se < -c)
    assert abs(H.power_tost(n, margin, sd, alpha) - want) < 0.03


def test_the_planned_spread_is_the_factorials_published_held_out_differences():
    """FACTORIAL_J is results.md's factorial row "J | long" and "J | none", digit for digit."""
    results = (ROOT / "docs" / "results.md").read_text()
    body = results.split("<!-- section factorial -->")[1].split("<!-- end factorial -->")[0]
    for gap, values in H.FACTORIAL_J.items():
        row = next(x for x in body.splitlines() if x.startswith(f"| J | {gap} |"))
        assert row.split("|")[3].strip() == " ".join(f"{v:+.1f}" for v in values)


def test_the_study_runs_the_seeds_its_power_analysis_asks_for_and_no_earlier_experiments():
    from scripts import reproduce

    effect = -sum(H.FACTORIAL_J["long"]) / len(H.FACTORIAL_J["long"])
    level = H.ALPHA / len(H.PRIMARY)
    spread = H.sd(H.FACTORIAL_J["long"])
    assert len(H.SEEDS) >= H.seeds_needed(lambda n: H.power_t(n, effect, spread, level))
    assert len(H.SEEDS) >= H.seeds_needed(lambda n: H.power_tost(n, H.MARGIN, spread, level))
    earlier = {int(s) for name in ("SEEDS5", "FACTORIAL_SEEDS", "LORA_SEEDS") for s in getattr(reproduce, name)}
    assert not earlier & set(H.SEEDS) and len(set(H.SEEDS)) == len(H.SEEDS)


def test_acc_and_best_at_k_are_the_expectations_of_the_sampled_measures():
    """Best@k of a prompt answered right with probability p is P(at least one of k samples right), the binomial
    sum; Acc@k is the mean probability, whatever k."""
    p = [0.0, 0.05, 0.3, 0.9, 1.0000000002]
    got = H.at_k(p, 8)
    best = [sum(math.comb(8, j) * q**j * (1 - q) ** (8 - j) for j in range(1, 9)) for q in (0, 0.05, 0.3, 0.9, 1)]
    assert got["Best@8"] == pytest.approx(100 * sum(best) / 5, abs=1e-9)
    assert got["Acc@8"] == pytest.approx(100 * (0.05 + 0.3 + 0.9 + 1) / 5, abs=1e-9)
    assert H.at_k([0.5], 1)["Best@1"] == pytest.approx(50.0)


def write_runs(root, probability, seeds=(1, 2, 3), steps=(5, 10)):
    """The study's runs as ablation.py writes them; each export's per-prompt probabilities from probability."""
    for task in H.TASKS.values():
        for agg in H.RULES:
            for seed in seeds:
                run = root / f"{task}-{agg}-s{seed}"
                run.mkdir()
                (run / "args.json").write_text(json.dumps({"agg": agg, "seed": seed, "policy_loss": "ppo",
                                                           "model": task, "steps": 3}))
                rows = [{"step": 0}] + [{"step": t, "reward/accuracy": 0.3, "length/mean": 10.0} for t in (1, 2, 3)]
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    exports = lambda run: [(s, f"{run.name}@{s}") for s in steps]
    return exports, lambda ckpt, task: probability(ckpt.split("@")[0], int(ckpt.split("@")[1]), task)


def test_the_report_tests_balanced_against_each_rule_at_the_peak_and_the_last_export(tmp_path):
    """d = balanced - other per seed at the peak (the largest export) and the last; Holm over the declared
    families; TOST for the primary four; every per-seed value in the table."""
    def probability(name, step, task):  # token falls away at the last export on the long gap; seq trails alike
        seed = int(name.rsplit("-s", 1)[1])
        base = 0.5 + 0.02 * seed + (0.1 if step == 5 else 0.0)
        loss = {"token": 0.01 * seed * (step == 10) * ("long" in task), "seq": 0.005, "balanced": 0.0}
        rule = next(a for a in H.RULES if f"-{a}-" in name)
        return [base - loss[rule], base - loss[rule] + 0.1]

    exports, probabilities = write_runs(tmp_path, probability)
    out = H.heldout_study(tmp_path, probabilities, exports)
    acc = {(a, s, step): H.at_k(probability(f"x-{a}-s{s}", step, "lab-check-long"))["Acc@8"]
           for a in H.RULES for s in (1, 2, 3) for step in (5, 10)}
    rows = {}
    for c in H.PRIMARY:
        _, m, point, other = c
        pick = (lambda a, s: max(acc[(a, s, 5)], acc[(a, s, 10)])) if point == "peak" else \
            (lambda a, s: acc[(a, s, 10)])
        rows[c] = [pick("balanced", s) - pick(other, s) for s in (1, 2, 3)]
    tests = {c: paired(d, H.MARGIN) for c, d in rows.items()}
    p_adj = dict(zip(H.PRIMARY, holm([tests[c]["p"] for c in H.PRIMARY])))
    for c, d in rows.items():
        head = f"| primary | coupled | Acc@8 | {c[2]} | balanced - {c[3]} |"
        row = next(x for x in out.splitlines() if x.startswith(head))
        r = tests[c]
        assert f"| {' '.join(f'{v:+.1f}' for v in d)} | {r['mean']:+.2f} | [{r['lo']:+.2f}, {r['hi']:+.2f}] |" in row
    # the peak is the first export for every rule: token's last-export loss is seen at the last point alone
    assert "| primary | coupled | Acc@8 | last | balanced - token | +1.0 +2.0 +3.0 | +2.00 |" in out
    assert "| primary | coupled | Acc@8 | peak | balanced - token | +0.0 +0.0 +0.0 | +0.00 |" in out
    assert "| secondary | control | Acc@8 | last | balanced - token | +0.0 +0.0 +0.0 |" in out
    assert out.count("| secondary |") == len(H.SECONDARY) and out.count("| primary |") == len(H.PRIMARY)
    seq_last = next(x for x in out.splitlines() if x.startswith("| primary | coupled | Acc@8 | last | balanced - seq"))
    assert f"{paired_p(p_adj, ('coupled', 'Acc@8', 'last', 'seq'))} (Holm)" in seq_last
    spread = paired(rows[("coupled", "Acc@8", "last", "token")], H.MARGIN)["sd"]  # 1.0: the deficits 1, 2, 3
    level = H.ALPHA / len(H.PRIMARY)
    power = H.power_t(3, -sum(H.FACTORIAL_J["long"]) / 12, spread, level)
    assert f"| last | balanced - token | {spread:.2f} | {power:.2f} |" in out
    assert "| coupled | token | 1 | 67.0 / 56.0 |" in out  # per seed: Acc@8 at the peak (step 5) / the last


def paired_p(adjusted: dict, c: tuple) -> str:
    from scripts.compare_rules import p_text

    return p_text(adjusted[c])


def test_the_report_refuses_a_missing_cell_or_exports_at_other_steps(tmp_path):
    exports, probabilities = write_runs(tmp_path, lambda name, step, task: [0.5])
    (tmp_path / "lab-check-nogap-seq-s2" / "args.json").unlink()
    with pytest.raises(ValueError, match="lab-check-nogap: no seq run of seed 2"):
        H.heldout_study(tmp_path, probabilities, exports)
    (tmp_path / "lab-check-nogap-seq-s2" / "args.json").write_text(json.dumps(
        {"agg": "seq", "seed": 2, "policy_loss": "ppo", "model": "lab-check-nogap", "steps": 3}))
    uneven = lambda run: [(s, f"{run.name}@{s}") for s in ((5,) if "token-s1" in run.name else (5, 10))]
    with pytest.raises(ValueError, match="exports are at different steps"):
        H.heldout_study(tmp_path, probabilities, uneven)


def test_the_design_table_is_the_one_results_md_publishes():
    """results.md's heldout-design section is what design() prints now: the design published before the runs."""
    results = (ROOT / "docs" / "results.md").read_text()
    body = results.split("<!-- section heldout-design -->")[1].split("<!-- end heldout-design -->")[0]
    assert H.design() in body


def test_the_docs_show_the_studys_commands():
    lab = (ROOT / "docs" / "lab.md").read_text()
    for a in H.ABLATIONS:
        assert f"python -m scripts.ablation {' '.join(a)}" in lab
