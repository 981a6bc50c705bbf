"""A reward kind added as a forker adds it, one entry of rewards.KINDS and its scorer beside it, nothing else,
is prepared, rendered, scored, trained on and evaluated.

The fork adds "graded": a short exact-match answer scored 1 when the response's first line is the answer and
0.5 otherwise. In a copy of the project so edited, the lab's addition problems relabelled as "graded" rows train
one step and are evaluated once. Every score of the kind is 0.5 or 1, so the step's mean reward is at least 0.5;
math's 0/1 scorer on the lab policy gives about 0.24 at step 1 (a run that scored the rows as math, or refused
the kind anywhere, fails the test).
"""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, cpu_env, project_copy

pytestmark = pytest.mark.slow

KINDS = 'KINDS = {\n    "math": {"reference": "answer", "score": score_math, "instruction": None},\n'
SCORER = '''def score_graded(response: str, answer, partial: bool, timeout: float) -> float:
    return 1.0 if response.strip().split("\\n")[0].strip() == str(answer).strip() else 0.5


'''
ENTRY = '    "graded": {"reference": "answer", "score": score_graded, "instruction": None},\n'


def fork(tmp_path):
    """A copy of the project with "graded" added in rewards.py."""
    return project_copy(tmp_path, "rewards.py", [(KINDS, SCORER + KINDS + ENTRY)])


def graded_rows(spec: str, path, limit: int) -> str:
    """The lab task's rows (the demo's addition problems) relabelled as the fork's kind."""
    from data.prepare import load_rows

    rows = [{**r, "kind": "graded"} for r in load_rows(spec)[:limit]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_kind_added_in_rewards_alone_is_trained_and_evaluated(tmp_path):
    copy = fork(tmp_path)
    train = graded_rows("demo", tmp_path / "train.jsonl", 256)
    held_out = graded_rows("demo-test", tmp_path / "test.jsonl", 16)
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "train_grpo.py", "--model", "lab", "--dataset", train, "--eval-dataset",
                          held_out, "--steps", "1", "--eval-interval", "1", "--save-interval", "1", "--output-dir",
                          str(out)], cwd=copy, capture_output=True, text=True, timeout=900, env=cpu_env())
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in rows if m["step"] == 1 and "reward/mean" in m)
    assert step["reward/mean"] >= 0.5 and step["reward/errors"] == 0, step  # every graded score is 0.5 or 1
    assert [m["step"] for m in rows if "eval/acc_greedy" in m] == [0, 1], rows  # held-out graded rows scored
    # the project itself refuses the kind in one line: the fork's entry is what made it work
    res = subprocess.run([sys.executable, "train_grpo.py", "--model", "lab", "--dataset", train, "--steps", "1",
                          "--output-dir", str(tmp_path / "refused")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=cpu_env())
    assert res.returncode != 0 and "graded" in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]
