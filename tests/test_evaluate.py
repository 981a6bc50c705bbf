"""evaluate.py: metrics by hand, and a real vLLM evaluation of the demo model on benchmark slices."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BENCHMARKS, ROOT

from evaluate import benchmark_metrics, pass_at_k

NO_EVAL = shutil.ignore_patterns("eval")


@pytest.mark.parametrize("n,c,k,expected", [
    (8, 0, 8, 0.0), (8, 8, 8, 1.0), (8, 8, 1, 1.0), (8, 0, 1, 0.0),
    (8, 1, 8, 1.0),            # n = k: solved iff any sample is correct
    (8, 1, 1, 1 / 8),
    (4, 2, 2, 1 - 1 / 6),      # 1 - C(2,2)/C(4,2)
    (5, 3, 3, 1.0),            # fewer wrong samples than k
])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_benchmark_metrics_by_hand():
    m = benchmark_metrics([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], 4)
    assert m["acc@1"] == m["acc@4"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert m["best@1"] == pytest.approx(m["acc@1"])
    assert m["best@4"] == pytest.approx(2 / 3)
    assert m["problems"] == 3


def test_a_partial_pass_is_not_solved():
    """A pass fraction (a cache of scoring version 1, or code_partial) counts as 0, as LiveCodeBench
    counts: Acc@k and Best@k take only full passes."""
    m = benchmark_metrics([[1, 0.5, 0.99, 0], [0.5, 0.5, 0.5, 0.5]], 4)
    assert m["acc@4"] == pytest.approx(0.25 / 2) and m["best@4"] == pytest.approx(0.5)


def test_benchmarks_with_their_tests_in_the_prompt_are_marked():
    from evaluate import TESTS_IN_PROMPT_NOTE, format_table, runs_table, settings_key

    shown = {**_results(0.5), "mbpp": {"acc@8": 0.7, "best@8": 0.9, "tests_in_prompt": True}}
    table = format_table({"mbpp": {**shown["mbpp"], "acc@1": 0.7, "best@1": 0.7, "problems": 257},
                          "humaneval": {"acc@1": 0.1, "acc@8": 0.1, "best@1": 0.1, "best@8": 0.3, "problems": 164}}, 8)
    assert "| mbpp*" in table and "| humaneval " in table and TESTS_IN_PROMPT_NOTE in table
    head = runs_table({"r": {0: shown}}, {"x": ["r"]}, ["demo-test", "mbpp"], 8).splitlines()[0]
    assert "mbpp* Acc@8" in head and "demo-test Acc@8" in head
    import argparse

    args = argparse.Namespace(template="plain", n=8, temperature=0.6, top_p=0.95, max_tokens=10, seed=0, limit=None,
                              max_model_len=None)
    assert settings_key(args)[1]["scoring"] == __import__("rewards").SCORING_VERSION  # caches keyed by it


def evaluate(*args, timeout=600):
    return subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


COMMON = ["--benchmarks", "math500,humaneval,demo-test", "--data-dir", str(BENCHMARKS), "--template", "plain",
          "--n", "3", "--max-tokens", "12", "--limit", "6", "--temperature", "1.0", "--top-p", "1.0",
          "--reward-workers", "2"]


@pytest.fixture(scope="module")
def fake_run(demo_dir, tmp_path_factory):
    """A run directory shaped like the trainer's: two checkpoints, args.json naming its initial
    policy (a copy of the demo model) and a metrics.jsonl."""
    root = tmp_path_factory.mktemp("runs")
    run = root / "demo-balanced"
    shutil.copytree(demo_dir / "model", root / "initial", ignore=NO_EVAL)
    for step in (10, 20):
        shutil.copytree(demo_dir / "model", run / "checkpoints" / f"step_{step:06d}", ignore=NO_EVAL)
    (run / "args.json").write_text(json.dumps({"agg": "balanced", "model": str(root / "initial")}))
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "loss/pg": 0.01 / step, "length/cv": 0.3, "length/mean": 7.0,
                                "length/pos_neg_gap": 5.0 - step / 10}) + "\n")
    return run


@pytest.mark.slow
def test_evaluate_run_end_to_end(fake_run):
    res = evaluate("--run", str(fake_run), "--plot", *COMMON)
    assert res.returncode == 0, res.stderr[-3000:]
    key_dirs = list((fake_run / "checkpoints" / "step_000010" / "eval").iterdir())
    assert len(key_dirs) == 1
    out = json.loads((key_dirs[0] / "results.json").read_text())["results"]
    assert set(out) == {"math500", "humaneval", "demo-test", "average"}
    for name in ("math500", "humaneval", "demo-test"):
        m = out[name]
        assert m["problems"] == 6
        # "skipped": the prompts the demo model's 512-token context cannot hold, scored 0 and said under the table
        assert set(m) - {"skipped"} == {"problems", "acc@1", "acc@3", "best@1", "best@3"}
        assert 0 <= m["acc@3"] <= m["best@3"] <= 1
        samples = [json.loads(x) for x in (key_dirs[0] / f"{name}.samples.jsonl").read_text().splitlines()]
        assert len({s["id"] for s in samples}) == 6 and all(len(s["scores"]) == 3 for s in samples)
    assert out["demo-test"]["acc@3"] > 0  # the demo model does solve some of its own task
    avg = out["average"]["acc@3"]
    assert avg == pytest.approx(sum(out[b]["acc@3"] for b in ("math500", "humaneval", "demo-test")) / 3)
    # step 0: the initial policy of args.json, evaluated (and cached) in its own directory
    initial = json.loads(next((fake_run.parent / "initial" / "eval").iterdir()).joinpath("results.json").read_text())
    assert initial["results"] == out  # the same weights and seeds as the checkpoints here

    table = (fake_run / "eval_table.md").read_text()
    assert table.startswith("settings: template=plain, n=3,") and "benchmarks=math500,humaneval,demo-test" in table
    assert "| initial policy | - | 0 |" in table
    assert "| peak | 20 |" in table and "| last | 20 |" in table and "demo-balanced" in table
    assert "| benchmark" in res.stdout and "average" in res.stdout
    for png in ("figure1_accuracy.png", "figure2_pg_loss.png", "figure3_length.png"):
        assert (fake_run / png).stat().st_size > 10_000

    # A second call finds the initial policy and both checkpoints evaluated and generates nothing.
    again = evaluate("--run", str(fake_run), *COMMON)
    assert again.returncode == 0 and again.stdout.count("already evaluated") == 3


def _results(acc: float) -> dict:
    return {"demo-test": {"acc@8": acc, "best@8": min(1.0, 2 * acc)}, "average": {"acc@8": acc, "best@8": 0.0}}


def test_seeds_of_one_setting_are_averaged(tmp_path):
    from evaluate import group_runs, runs_table

    runs = {}
    for agg, seed, accs in [("seq", 1, (0.3, 0.5, 0.4)), ("seq", 2, (0.3, 0.6, 0.7)), ("token", 1, (0.3, 0.2, 0.1))]:
        run = tmp_path / f"lab-{agg}-s{seed}"
        run.mkdir()
        args = {"model": "lab", "agg": agg, "seed": seed, "output_dir": str(run), "lr": 2e-4, "steps": 40}
        (run / "args.json").write_text(json.dumps(args))
        runs[str(run)] = {step: _results(a) for step, a in zip((0, 10, 20), accs)}
    groups = group_runs(list(runs))
    assert groups == {"seq": [str(tmp_path / "lab-seq-s1"), str(tmp_path / "lab-seq-s2")],
                      "token": [str(tmp_path / "lab-token-s1")]}
    lines = runs_table(runs, groups, ["demo-test"], 8).splitlines()
    assert lines[2] == "| initial policy | - | 0 | 30.0 / 60.0 |"
    # each seed's own peak (steps 10 and 20): 50 and 70 -> 60 ± 14.1 (sample std); last: 40 and 70
    assert lines[3] == "| seq (2 seeds) | peak | 10, 20 | 60.0 ± 14.1 / 100.0 ± 0.0 |"
    assert lines[4] == "| seq (2 seeds) | last | 20, 20 | 55.0 ± 21.2 / 90.0 ± 14.1 |"
    assert lines[5] == "| token | peak | 10 | 20.0 / 40.0 |"  # the initial policy is never the peak
    # another model is another setting, labelled by what differs
    other = tmp_path / "lab-nogap-seq-s1"
    other.mkdir()
    (other / "args.json").write_text(json.dumps({"model": "lab-nogap", "agg": "seq", "seed": 1, "lr": 2e-4}))
    labels = set(group_runs([*runs, str(other)]))
    assert labels == {"lab seq", "lab token", "lab-nogap seq"}
    # a switch that one setting turns on (ablation.py's dr-grpo: Dr. GRPO) names it there, nothing elsewhere
    dr = tmp_path / "lab-dr-grpo-s1"
    dr.mkdir()
    (dr / "args.json").write_text(json.dumps({"model": "lab", "agg": "dr-grpo", "seed": 1, "lr": 2e-4,
                                              "no_std_norm": True}))
    for run in runs:
        a = json.loads((Path(run) / "args.json").read_text())
        (Path(run) / "args.json").write_text(json.dumps({**a, "no_std_norm": False}))
    assert set(group_runs([*runs, str(dr)])) == {"seq", "token", "dr-grpo no-std-norm"}


@pytest.fixture(scope="module")
def evaluated(demo_dir, tmp_path_factory) -> Path:
    """A copy of the demo model evaluated by one process (its cache in eval/): the result the tests below
    resume and shard against."""
    ckpt = tmp_path_factory.mktemp("evaluated") / "model"
    shutil.copytree(demo_dir / "model", ckpt, ignore=NO_EVAL)
    res = evaluate("--model", str(ckpt), *COMMON, "--data-parallel-size", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    return ckpt


@pytest.mark.slow
def test_killed_evaluation_resumes(evaluated, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(evaluated, ckpt)
    cache = next((ckpt / "eval").iterdir())
    full = json.loads((cache / "results.json").read_text())["results"]
    # simulate a kill: no results, demo-test samples cut after two problems and half a line
    (cache / "results.json").unlink()
    lines = (cache / "demo-test.samples.jsonl").read_text().splitlines()
    (cache / "demo-test.samples.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])
    second = evaluate("--model", str(ckpt), *COMMON)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = json.loads((cache / "results.json").read_text())["results"]
    assert resumed["math500"] == full["math500"] and resumed["humaneval"] == full["humaneval"]
    ids = [json.loads(x)["id"] for x in (cache / "demo-test.samples.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 6  # two cached problems kept, the cut one and three more redone
    assert math.isfinite(resumed["demo-test"]["acc@3"])


def test_unknown_benchmark(demo_dir):
    res = evaluate("--model", str(demo_dir / "model"), "--benchmarks", "aime2099")
    assert res.returncode != 0 and "Traceback" not in res.stderr and "unknown dataset 'aime2099'" in res.stderr


def test_file_without_answers(demo_dir, tmp_path):
    bad = tmp_path / "noanswers.jsonl"
    bad.write_text(json.dumps({"problem": "What is 1+1?"}) + "\n")
    res = evaluate("--model", str(demo_dir / "model"), "--benchmarks", str(bad))
    assert res.returncode != 0 and "Traceback" not in res.stderr and "row 0 has no 'answer'" in res.stderr


def test_checkpoint_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    res = evaluate("--model", str(tmp_path), "--benchmarks", "demo-test")
    assert res.returncode != 0 and "Traceback" not in res.stderr and "no model weights" in res.stderr


def test_code_benchmark_without_bubblewrap_fails_in_one_line(demo_dir, tmp_path, path_without_bwrap):
    import os

    res = subprocess.run([sys.executable, "evaluate.py", "--model", str(demo_dir / "model"), "--benchmarks",
                          "math500,humaneval", "--data-dir", str(BENCHMARKS)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PATH": path_without_bwrap})
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "evaluate.py: error: code rewards run model-written code and need bubblewrap" in res.stderr


@pytest.mark.slow
def test_data_parallel_shards_merge_to_the_one_process_result(evaluated, demo_dir, tmp_path):
    two = tmp_path / "two"
    shutil.copytree(demo_dir / "model", two, ignore=NO_EVAL)
    b = evaluate("--model", str(two), *COMMON, "--data-parallel-size", "2")  # two engines, one process each
    assert b.returncode == 0, b.stderr[-2000:]
    cache_a, cache_b = next((evaluated / "eval").iterdir()), next((two / "eval").iterdir())
    assert cache_a.name == cache_b.name  # the cache does not depend on the sharding
    merged = json.loads((cache_b / "results.json").read_text())["results"]
    assert merged == json.loads((cache_a / "results.json").read_text())["results"]
    shards = [{json.loads(x)["id"] for x in (cache_b / f"demo-test.samples.{i}of2.jsonl").read_text().splitlines()}
              for i in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 3 and not shards[0] & shards[1]
    # resumed with another number of engines: everything is found in the shards' caches
    (cache_b / "results.json").unlink()
    c = evaluate("--model", str(two), *COMMON, "--data-parallel-size", "1")
    assert c.returncode == 0 and "sampled" not in c.stdout
    assert json.loads((cache_b / "results.json").read_text())["results"] == merged
