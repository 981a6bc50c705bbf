"""compare_rules.py: the paired test, the declared measure and the pairing check, on runs written the
way the trainer writes them (args.json, metrics.jsonl); the prediction on the shipped lab-check policy."""

import json
import math

import pytest

from scripts import compare_rules as C


def t_sf_numeric(t: float, df: int) -> float:
    """Two-sided p of Student's t by Simpson's rule on the density: an independent reference."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    n, a = 20000, abs(t)
    h = a / n
    inner = f(0) + f(a) + sum((4 if k % 2 else 2) * f(k * h) for k in range(1, n))
    return 1 - 2 * inner * h / 3


@pytest.mark.parametrize("d", [[1, 2, 3, 4, 5], [0.4, -0.2, 1.1, 0.3, 0.9], [-3.0, -2.5, -4.1]])
def test_paired_t_test_matches_the_t_distribution(d):
    t, p = C.t_test(d)
    n, m = len(d), sum(d) / len(d)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))
    assert t == pytest.approx(m / (sd / math.sqrt(n)))
    assert p == pytest.approx(t_sf_numeric(t, n - 1), abs=1e-6)
    assert C.t_test([1.0, 1.0, 1.0]) == (math.inf, 0.0) and C.t_test([0.0, 0.0]) == (0.0, 1.0)


def test_holm_steps_down_and_stays_monotone():
    assert C.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert C.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])


def write_run(root, agg, seed, acc, first=(0.25, 20.0), steps=None):
    run = root / f"lab-check-{agg}-s{seed}"
    run.mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"agg": agg, "seed": seed, "policy_loss": "ppo", "model": "lab",
                                               "steps": steps or len(acc)}))
    rows = [{"step": 0, "eval/acc": 0.1}]
    for step, a in enumerate(acc, 1):
        a, length = first if step == 1 else (a, 15.0)
        rows.append({"step": step, "reward/accuracy": a, "length/mean": length, "length/pos_neg_gap": 5.0,
                     "loss/pg": 0.1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_compare_reports_the_declared_auc_per_seed_and_the_paired_test(tmp_path):
    curves = {("balanced", 1): [0, 0.5, 0.6, 0.7, 0.8, 0.8], ("balanced", 2): [0, 0.4, 0.6, 0.6, 0.7, 0.8],
              ("token", 1): [0, 0.4, 0.5, 0.6, 0.7, 0.7], ("token", 2): [0, 0.4, 0.45, 0.5, 0.6, 0.7]}
    for (agg, seed), acc in curves.items():
        write_run(tmp_path, agg, seed, acc)
    out = C.compare(tmp_path)
    auc = {k: 100 * (0.25 + sum(v[1:])) / 6 for k, v in curves.items()}  # step 1 is the shared first rollout
    row = next(x for x in out.splitlines() if x.startswith("| token |"))
    assert f"{auc[('token', 1)]:.1f} | {auc[('token', 2)]:.1f}" in row
    d = [auc[("token", s)] - auc[("balanced", s)] for s in (1, 2)]
    t, p = C.t_test(d)
    test_row = next(x for x in out.splitlines() if x.startswith("| token |") and "t-test" not in x and x != row)
    assert f"{sum(d) / 2:+.2f} | {t:+.2f} | {p:.3f}" in test_row


def test_compare_refuses_runs_that_are_not_paired_or_not_finished(tmp_path):
    write_run(tmp_path, "balanced", 1, [0, 0.5, 0.6])
    write_run(tmp_path, "balanced", 2, [0, 0.5, 0.6])
    write_run(tmp_path, "token", 1, [0, 0.5, 0.6])
    write_run(tmp_path, "token", 2, [0, 0.5, 0.6], first=(0.30, 20.0))
    with pytest.raises(ValueError, match="seed 2: step 1's rollouts differ across rules"):
        C.compare(tmp_path)
    single = tmp_path / "single"
    write_run(single, "balanced", 1, [0, 0.5])
    write_run(single, "token", 1, [0, 0.5])
    with pytest.raises(ValueError, match="fewer than 2 seeds"):
        C.compare(single)
    unfinished = tmp_path / "unfinished"
    for seed in (1, 2):
        write_run(unfinished, "balanced", seed, [0, 0.5, 0.6, 0.7])
        write_run(unfinished, "token", seed, [0, 0.5, 0.6, 0.7][: 3 if seed == 2 else 4], steps=4)
    with pytest.raises(ValueError, match="token-s2: no training step 4 .*the same ablation.py command resumes"):
        C.compare(unfinished)
    with pytest.raises(ValueError, match="no such directory"):
        C.compare(tmp_path / "nope")


def test_the_ablations_dr_grpo_is_dr_grpo_and_every_other_rule_keeps_the_std():
    """Dr. GRPO is its normaliser with unscaled advantages: the ablation's dr-grpo run gets both."""
    import train_grpo
    from scripts import ablation

    for agg in train_grpo.AGGS:
        a = train_grpo.parse_args(ablation.train_args("lab", agg, "ppo", 1, "runs/x", ["--lr", "1e-4"]))
        assert (a.agg, a.no_std_norm, a.lr) == (agg, agg == "dr-grpo", 1e-4)


def test_ablation_records_the_commit_that_trains_each_run():
    from scripts import ablation

    sha = ablation.code_commit()
    assert len(sha.split("+")[0]) == 40 or sha == "unknown"


def test_reproduce_lists_every_experiment_and_refuses_an_unknown_one():
    import subprocess
    import sys

    from conftest import ROOT

    res = subprocess.run([sys.executable, "-m", "scripts.reproduce", "--list"], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == 0
    from scripts import reproduce

    for name, (_, ablations, _tables) in reproduce.EXPERIMENTS.items():
        assert res.stdout.count(f"{name}: ") >= 1
        for a in ablations:
            assert f"python -m scripts.ablation {' '.join(a)}" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "scripts.reproduce", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("reproduce.py: error: unknown")


def test_reproduce_rewrites_only_the_sections_asked_for_with_their_runs_commits(tmp_path, monkeypatch):
    from scripts import reproduce

    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    monkeypatch.setattr(reproduce, "RESULTS", tmp_path / "results.md")
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "x-seq-s1.commit").write_text("a" * 40 + "\n")
    (tmp_path / "runs" / "a" / "x-token-s1.commit").write_text("b" * 40 + "+dirty\n")
    (tmp_path / "table_one.py").write_text("print('| seq | 1.0 ± 0.1 |')\n")  # a table's module, run with -m
    (tmp_path / "table_two.py").write_text("print('| two | 2 ± 0 |')\n")
    monkeypatch.setattr(reproduce, "EXPERIMENTS", {"one": ("first", [["--model", "lab"]], [["table_one", "runs/a"]]),
                                                   "two": ("second", [], [["table_two"]])})
    reproduce.write_sections(["one", "two"])
    text = (tmp_path / "results.md").read_text()
    assert "| seq | 1.0 ± 0.1 |" in text and "| two | 2 ± 0 |" in text
    assert f"Runs trained at commits {'a' * 10}, {'b' * 10}+dirty" in text
    (tmp_path / "table_two.py").write_text("print('| two | 3 ± 0 |')\n")
    reproduce.write_sections(["two"])
    again = (tmp_path / "results.md").read_text()
    assert "| two | 3 ± 0 |" in again and "| two | 2 ± 0 |" not in again and "| seq | 1.0 ± 0.1 |" in again
    assert again.count("<!-- section one -->") == 1 and again.count("<!-- section two -->") == 1


@pytest.mark.parametrize("d,margin", [([0.4, -0.2, 1.1, 0.3, 0.9], 0.5), ([-0.1, 0.05, 0.1, -0.02], 0.5),
                                      ([2.0, 2.5, 1.5], 1.0)])
def test_the_factorials_ci_and_equivalence_test_follow_the_t_distribution(d, margin):
    r = C.paired(d, margin)
    n, se = len(d), r["sd"] / math.sqrt(len(d))
    q = C.t_quantile(0.975, n - 1)
    assert t_sf_numeric(q, n - 1) == pytest.approx(0.05, abs=1e-6)  # the 95% CI's half-width is q se
    assert (r["lo"], r["hi"]) == pytest.approx((r["mean"] - q * se, r["mean"] + q * se))
    one_sided = lambda t: t_sf_numeric(t, n - 1) / 2 if t > 0 else 1 - t_sf_numeric(t, n - 1) / 2  # noqa: E731
    assert r["p_tost"] == pytest.approx(max(one_sided((r["mean"] + margin) / se), one_sided((margin - r["mean"]) / se)),
                                        abs=1e-6)
    # equivalence at 0.05 exactly when the 90% CI lies inside the margin
    q90 = C.t_quantile(0.95, n - 1)
    assert (r["p_tost"] < 0.05) == (abs(r["mean"]) + q90 * se < margin)
    assert r["dz"] == pytest.approx(r["mean"] / r["sd"])


def test_a_p_value_below_0001_keeps_its_first_digit():
    """The factorial's primary p was 0.0003: printed 0.000, it read as zero."""
    assert [C.p_text(p) for p in (0.00031, 0.0012, 0.0234, 0.998)] == ["0.0003", "0.001", "0.023", "0.998"]


def test_factorial_reports_the_difference_in_differences_per_seed(tmp_path):
    """token - balanced per seed within each gap, then D = d(gap) - d(none): the declared test's numbers."""
    cost = {"none": 0.0, "middle": 0.02, "long": 0.05}  # what token loses against balanced, times the seed
    aucs = {}
    for gap, task in C.GAPS.items():
        for agg in C.FACTORIAL_RULES:
            for seed in (1, 2, 3):
                late = 0.5 + 0.1 * seed - (0.01 + cost[gap] * seed) * (agg == "token")
                run = tmp_path / f"{task}-{agg}-s{seed}"
                run.mkdir()
                (run / "args.json").write_text(json.dumps({"agg": agg, "seed": seed, "policy_loss": "ppo",
                                                           "model": task, "steps": 3}))
                rows = [{"step": 0}] + [{"step": t, "reward/accuracy": [0.3, late, late][t - 1], "length/mean": 10.0,
                                         "length/pos_neg_gap": 5.0, "loss/pg": 0.1} for t in (1, 2, 3)]
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                aucs[(gap, agg, seed)] = 100 * (0.3 + 2 * late) / 3
    out = C.factorial(tmp_path, last_J=lambda run, task: 50.0 + len(task) + 2 * run.name.count("token"),
                      figure=tmp_path / "factorial.png")
    assert (tmp_path / "factorial.png").stat().st_size > 10_000
    d = {gap: [aucs[(gap, "token", s)] - aucs[(gap, "balanced", s)] for s in (1, 2, 3)] for gap in C.GAPS}
    for gap in ("long", "middle"):
        D = [a - b for a, b in zip(d[gap], d["none"])]
        r = C.paired(D, C.MARGIN["AUC"])
        assert r["mean"] < -1 and r["sd"] > 0
        row = next(x for x in out.splitlines() if x.startswith(f"| AUC | {gap} - none |"))
        assert " ".join(f"{v:+.1f}" for v in D) in row and f"{r['mean']:+.2f} | [{r['lo']:+.2f}, {r['hi']:+.2f}]" in row
        primary = f"| {C.p_text(r['p'])} | ± 0.5 | {C.p_text(r['p_tost'])} |"
        assert (primary if gap == "long" else "(Holm) | - | - |") in row
    assert "| J | long - none | +0.0 +0.0 +0.0 | +0.00 |" in out  # J's token - balanced is 2 in every gap
    assert "| J | none | +2.0 +2.0 +2.0 | +2.00 |" in out
    (tmp_path / "lab-check-long-token-s3" / "args.json").unlink()  # a cell one seed short: not silently dropped
    with pytest.raises(ValueError, match="lab-check-long: no token run of seed 3"):
        C.factorial(tmp_path, last_J=lambda run, task: 0.0)


def prediction_section() -> dict[str, dict]:
    """results.md's factorial prediction, per task: the policy's line, and token's ratio to balanced in the
    first-step and steady tables."""
    from conftest import ROOT

    text = (ROOT / "docs" / "results.md").read_text()
    body = text.split("<!-- section factorial-prediction -->")[1].split("<!-- end factorial-prediction -->")[0]
    out = {}
    for block in body.split("`python -m scripts.compare_rules --predict ")[1:]:
        task, lines = block.split(" ", 1)[0], block.splitlines()
        head = next(x for x in lines if x.startswith(f"{task}: J "))
        token = [x.split("|")[-2].strip() for x in lines if x.startswith("| token |")]
        out[task] = {"head": head, "first": token[0], "steady": token[1],
                     "length": head.rsplit("mean length ", 1)[1]}
    return out


def test_the_factorials_design_table_is_its_prediction():
    """docs/lab.md's table of token / balanced per gap is the prediction results.md holds, digit for digit."""
    from conftest import ROOT

    pred = prediction_section()
    assert set(pred) == set(C.GAPS.values())
    lab = (ROOT / "docs" / "lab.md").read_text()
    for gap, task in C.GAPS.items():
        p = pred[task]
        assert f"| {gap} | {task} | {p['length']} | {p['first']} | {p['steady']} |" in lab


@pytest.mark.slow  # a forward pass over the 200 held-out prompts' 27 right answers each: about 6 s
def test_a_checkpoints_decisions_are_the_predictions_baseline():
    """J and the two decisions of a checkpoint on disk (what the factorial reads at each run's last one) are
    what results.md's prediction printed for the shipped lab-check policy."""
    from data.demo import model_dir

    m = C.checkpoint_decisions(model_dir("lab-check"), "lab-check")
    assert len(m["per_prompt"]) == 200 and sum(m["per_prompt"]) / 200 == pytest.approx(m["J"], rel=1e-12)
    assert 0 < min(m["per_prompt"]) and max(m["per_prompt"]) < 1  # each prompt's own probability, not a sum
    assert (f"lab-check: J {m['J']:.4f} (right answers, held-out prompts), check first {m['check_first']:.3f}, "
            f"answer after one check {m['answer_after_check']:.3f};") in prediction_section()["lab-check"]["head"]


def test_the_lora_study_tests_the_deficit_per_rank_and_lora_against_full(tmp_path):
    """Per arm d = token - balanced per seed, L = LoRA - full per rule, D = d(LoRA) - d(full): the declared tests'
    numbers, each arm read from its own directory and checked to be the arm it claims."""
    cost = {"full": 0.03, "r1": 0.05, "r8": 0.0}  # token's loss against balanced, times the seed
    slower = {"full": 0.0, "r1": 0.02, "r8": 0.01}  # LoRA's, under either rule
    aucs = {}
    for arm, flags in C.LORA_ARMS.items():
        rank = int(flags[1]) if flags else 0
        for agg in C.FACTORIAL_RULES:
            for seed in (1, 2, 3):
                late = 0.6 + 0.05 * seed - slower[arm] * (1 + seed % 2) - cost[arm] * seed * (agg == "token")
                run = tmp_path / arm / f"{C.LORA_TASK}-{agg}-s{seed}"
                run.mkdir(parents=True)
                (run / "args.json").write_text(json.dumps({"agg": agg, "seed": seed, "policy_loss": "ppo",
                                                           "model": C.LORA_TASK, "steps": 3, "lora_rank": rank}))
                rows = [{"step": 0}] + [{"step": t, "reward/accuracy": [0.3, late, late][t - 1], "length/mean": 10.0,
                                         "length/pos_neg_gap": 5.0, "loss/pg": 0.1} for t in (1, 2, 3)]
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                aucs[(arm, agg, seed)] = 100 * (0.3 + 2 * late) / 3
    out = C.lora_study(tmp_path, last_J=lambda run, task: 80.0, figure=tmp_path / "lora.png")
    assert (tmp_path / "lora.png").stat().st_size > 10_000
    d = {arm: [aucs[(arm, "token", s)] - aucs[(arm, "balanced", s)] for s in (1, 2, 3)] for arm in C.LORA_ARMS}
    rows = {x.split(" | ")[0][2:]: x for x in out.splitlines() if x.startswith(("| d, ", "| L, ", "| D, "))}
    assert len(rows) == 9
    for name, v in {"d, r1": d["r1"], "d, full": d["full"], "D, r1 - full": [a - b for a, b in zip(d["r1"], d["full"])],
                    "L, r8, balanced": [aucs[("r8", "balanced", s)] - aucs[("full", "balanced", s)] for s in (1, 2, 3)]
                    }.items():
        r = C.paired(v, C.LORA_MARGIN)
        assert f"| {' '.join(f'{x:+.1f}' for x in v)} | {r['mean']:+.2f} | [{r['lo']:+.2f}, {r['hi']:+.2f}] |" \
            in rows[name], name
    assert rows["d, r8"].split(" | ")[2] == "+0.0 +0.0 +0.0"  # r8 costs token nothing here
    # an arm's directory holding another arm's runs, or a cell a seed short, is refused in one line
    args = tmp_path / "r8" / f"{C.LORA_TASK}-token-s2" / "args.json"
    args.write_text(args.read_text().replace('"lora_rank": 8', '"lora_rank": 1'))
    with pytest.raises(ValueError, match="--lora-rank 1, in .*r8, the r8 arm's directory"):
        C.lora_study(tmp_path, last_J=lambda run, task: 0.0)
    args.unlink()
    with pytest.raises(ValueError, match="r8: no token run of seed 2"):
        C.lora_study(tmp_path, last_J=lambda run, task: 0.0)


def test_the_lora_studys_design_table_is_its_prediction():
    """docs/lora.md's table of token / balanced per arm is what results.md's LoRA prediction printed for that arm's
    flags, digit for digit."""
    from conftest import ROOT

    text = (ROOT / "docs" / "results.md").read_text()
    body = text.split("<!-- section lora-prediction -->")[1].split("<!-- end lora-prediction -->")[0]
    blocks = body.split("`python -m scripts.compare_rules --predict ")[1:]
    lora = (ROOT / "docs" / "lora.md").read_text()
    assert len(blocks) == len(C.LORA_ARMS)
    for (arm, flags), block in zip(C.LORA_ARMS.items(), blocks):
        command = block.split("`")[0].split()  # TASK ... -- ... and the arm's own flags last
        assert command[0] == C.LORA_TASK and command[len(command) - len(flags):] == flags
        assert ("--lora-rank" in command) == bool(flags)
        token = [x.split("|")[-2].strip() for x in block.splitlines() if x.startswith("| token |")]
        assert f"| {arm} | {token[0]} | {token[1]} |" in lora
