"""The aggregation lab (data/demo.py, `--model lab` / `lab-nogap`) and the one-command ablation.

The lab's policies must put the trainer in the regime the paper is about: response lengths that
vary within a group, failures longer than successes (lab) or not (lab-nogap). The properties are
read from the trainer's own metrics.jsonl on short runs at the lab's defaults."""

import json
import random
import re
import subprocess
import sys

import pytest
from conftest import ROOT, cpu_env

from data import demo


def ramble(text: str) -> int:
    return text.count(" so") + text.count(" wait")


@pytest.mark.parametrize("task", ["lab", "lab-nogap", "lab-nogap-hi"])
def test_warm_up_targets_couple_length_to_correctness_only_in_the_lab(task):
    rng = random.Random(0)
    right, wrong = [], []
    for _ in range(4000):
        a, b = rng.randrange(50), rng.randrange(50)
        text = demo.sft_response(task, a, b, rng)
        (right if f"\\boxed{{{a + b}}}" in text else wrong).append(ramble(text))
    assert len(right) / 4000 == pytest.approx(demo.P_CORRECT[task], abs=0.03)
    gap = sum(wrong) / len(wrong) - sum(right) / len(right)
    if task == "lab":
        assert gap > 8  # U{6..30} against U{0..10}: 18 - 5 = 13 " wait" tokens
    else:
        assert abs(gap) < 1
    assert demo.sft_response("demo", 3, 4, random.Random(0)) in (" \\boxed{7}", " \\boxed{6}", " \\boxed{8}")


@pytest.mark.parametrize("task", ["lab-check", "lab-check-nogap", "lab-check-long"])
def test_check_targets_are_right_only_after_exactly_one_check(task):
    """lab-check: a right answer needs the one " check" the long failures repeat; its control makes a
    loop two checks, so failures are no longer than successes; lab-check-long makes it 30 to 70."""
    rng = random.Random(0)
    kinds, lengths = {"right": 0, "guess": 0, "loop": 0}, {"right": [], "wrong": []}
    for _ in range(4000):
        a, b = rng.randrange(50), rng.randrange(1, 50)
        text = demo.sft_response(task, a, b, rng)
        checks = text.count(" check")
        if checks == 0:
            assert text in (f" \\boxed{{{a + b - 1}}}", f" \\boxed{{{a + b + 1}}}")
            kinds["guess"] += 1
        elif checks == 1:
            assert text == f" check \\boxed{{{a + b}}}"
            kinds["right"] += 1
        else:
            assert text == " check" * checks + f" \\boxed{{{a}}}"
            assert demo.CHECK_LOOP[task][0] <= checks <= demo.CHECK_LOOP[task][1]
            kinds["loop"] += 1
        lengths["right" if checks == 1 else "wrong"].append(checks)
    assert kinds["right"] / 4000 == pytest.approx(0.3, abs=0.03)
    assert kinds["guess"] / 4000 == pytest.approx(0.4, abs=0.03)
    gap = sum(lengths["wrong"]) / len(lengths["wrong"]) - 1  # in check tokens; the answers differ by <= 1 token
    # in checks: lab-check (0.4 x 0 + 0.3 x 14) / 0.7 - 1 = 5, lab-check-long (0.3 x 50) / 0.7 - 1 = 20.4
    assert {"lab-check": 4 < gap < 6, "lab-check-nogap": abs(gap) < 0.5, "lab-check-long": 19 < gap < 22}[task]


def test_build_writes_a_policy_that_loads_with_single_token_rambles(tmp_path, monkeypatch):
    """`python -m data.demo lab --build` (a few warm-up steps here): a checkpoint transformers loads,
    whose tokenizer spells a lab response back exactly, one token per ramble word."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(demo, "SFT_STEPS", {"lab": 3})
    monkeypatch.setattr(demo, "SFT_BATCH", 4)
    demo.build("lab", tmp_path / "lab")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lab")
    tok = AutoTokenizer.from_pretrained(tmp_path / "lab")
    text = " so so wait wait wait \\boxed{57}"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert len(tok(" so wait wait")["input_ids"]) == 3
    assert model.config.tie_word_embeddings and len(tok) <= model.config.vocab_size


def test_shipped_policies_are_copied_with_their_task(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "ROOT", tmp_path)
    for task in demo.TASKS:
        d = demo.ensure_demo(task)
        shipped = (demo.SHIPPED / task / "model.safetensors").read_bytes()
        assert (d / "model" / "model.safetensors").read_bytes() == shipped
        train = [json.loads(x)["id"] for x in (d / "train.jsonl").read_text().splitlines()]
        test = [json.loads(x)["id"] for x in (d / "test.jsonl").read_text().splitlines()]
        assert len(train) == 2300 and len(test) == 200 and not set(train) & set(test)
        assert demo.ensure_demo(task) == d  # cached
    with pytest.raises(ValueError, match="unknown offline task"):
        demo.ensure_demo("nope")


EVAL = "--benchmarks demo-test --template plain --n 2 --limit 32 --temperature 1.0 --top-p 1.0 --max-tokens 48"
STEPS = "4"


def metrics(run) -> list[dict]:
    return [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss/pg" in m]


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    """`ablation.py` on the lab, one seed, a few steps: three 2-rank runs, then evaluate.py."""
    out = tmp_path_factory.mktemp("ablation")
    cmd = [sys.executable, "-m", "scripts.ablation", "--model", "lab", "--seeds", "1", "--out", str(out),
           "--eval-args", EVAL,
           "--", "--steps", STEPS]
    res = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, cmd, res


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["seq", "token", "balanced"])
def test_lab_lengths_vary_and_failures_are_longer(ablation, agg):
    steps = metrics(ablation[0] / f"lab-{agg}-s1")
    assert len(steps) == int(STEPS)
    mean = lambda k: sum(m[k] for m in steps) / len(steps)  # noqa: E731
    assert mean("length/cv") >= 0.2
    assert mean("length/pos_neg_gap") >= 0.2 * mean("length/mean")


@pytest.mark.slow
def test_lab_pg_loss_is_zero_on_policy_only_for_seq_and_balanced(ablation):
    """On-policy with binary rewards, seq and balanced weigh the positive and negative advantages
    of a group equally, so the surrogate is 0; token weighs the longer failures more (Figure 2)."""
    pg = {agg: [m["loss/pg"] for m in metrics(ablation[0] / f"lab-{agg}-s1")] for agg in ("seq", "token", "balanced")}
    assert all(abs(x) <= 1e-5 for x in pg["seq"] + pg["balanced"]), pg
    assert sum(abs(x) for x in pg["token"]) / len(pg["token"]) >= 0.02, pg


@pytest.mark.slow
def test_ablation_writes_the_table_and_figures_and_resumes(ablation):
    out, cmd, res = ablation
    table = (out / "eval_table.md").read_text()
    assert "| initial policy | - | 0 |" in table
    for agg in ("seq", "token", "balanced"):
        assert f"| lab-{agg}-s1 | peak | {STEPS} |" in table and f"| lab-{agg}-s1 | last | {STEPS} |" in table
    for png in ("figure1_accuracy.png", "figure2_pg_loss.png", "figure3_length.png"):
        assert (out / png).stat().st_size > 10_000
    assert "[ablation] training" in res.stdout and "evaluation" in res.stdout
    # each launch meets on a port of its own, not the launcher's default that another run on this host holds
    ports = {re.search(r"master_port=(\d+)", (out / f"lab-{agg}-s1.log").read_text())[1] for agg in ("seq", "token")}
    assert ports and "29500" not in ports, ports
    # the same command again: nothing is retrained or resampled
    again = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:]
    assert again.stdout.count("already trained") == 3 and "trained in" not in again.stdout
    assert "already evaluated" in (out / "evaluate.log").read_text()


@pytest.mark.slow
def test_lab_nogap_keeps_the_lengths_without_the_gap(tmp_path):
    """The control at its defaults, with 256 prompts a step for a precise gap (its standard error
    over 32 groups is ~0.8 tokens, against a bound of ~1)."""
    from conftest import deepspeed_run

    res = deepspeed_run(2, "train_grpo.py", "--model", "lab-nogap", "--agg", "token", "--steps", "2",
                        "--prompts-per-step", "256", "--eval-dataset", "", "--output-dir", str(tmp_path / "run"),
                        port=29631)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    steps = metrics(tmp_path / "run")
    mean = lambda k: sum(m[k] for m in steps) / len(steps)  # noqa: E731
    assert mean("length/cv") >= 0.2
    assert abs(mean("length/pos_neg_gap")) <= 0.05 * mean("length/mean")
