"""A rule added as a forker adds it, in train_grpo.py alone, is held to every property test, measured right by
the tools, and changes no published experiment.

The fork adds foo, w_i = 1 / (G sqrt(L_i)): its name in AGGS, one branch in aggregation_weights and a row of
its docstring, nothing else. In a copy of the project so edited, the rule-property tests (the weights' split
and order invariance, the gradient's invariance to ranks and micro-batches, packed rows against padded ones)
run foo with no test edited and pass, as do the other tests of the rules and the docs; the tools' scale of
foo's loss, sum_i w_i L_i, is mean_i sqrt(L_i) computed directly (a tool that assumed a mean rule's 1 would
be 4x off); `reproduce --list` prints what it prints for the project as it is.
"""

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT, cpu_env, project_copy

pytestmark = pytest.mark.slow

AGGS = 'AGGS = ["seq", "token", "balanced", "balanced-batch", "token-batch", "dr-grpo", "seq-sum"]\n'
ROW = ("    seq-sum         1                                        sum_i sum_t l / B                "
       "verl seq-mean-token-sum\n")
BRANCH = '''    else:
        raise ValueError(f"unknown aggregation {agg!r}")
'''
EDITS = [(AGGS, AGGS.replace('"seq-sum"]', '"seq-sum", "foo"]')),
         (ROW, ROW + "    foo             sqrt(L_i)                                (1/G) sum_i sum_t l / sqrt(L_i)  "
                     "a fork\n"),
         (BRANCH, '''    elif agg == "foo":
        w = 1.0 / (group_size * L.sqrt())
''' + BRANCH)]


def fork(tmp_path):
    """A copy of the project with foo added in train_grpo.py."""
    return project_copy(tmp_path, "train_grpo.py", EDITS)


def run(cwd, *argv, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=cpu_env())


def test_a_rule_added_in_the_trainer_alone_is_tested_measured_and_published_right(tmp_path):
    copy = fork(tmp_path)
    tests = run(copy, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/test_aggregation.py", "tests/test_docs.py",
                "tests/test_compare.py", timeout=1500)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    # the gradient's invariance: foo's cases, its probe runs alone (GRAD_PROBE_RULE; the others are the project's)
    invariance = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                                 "tests/test_invariance.py", "-k", "foo"], cwd=copy, capture_output=True, text=True,
                                timeout=900, env=cpu_env(GRAD_PROBE_RULE="foo"))
    assert invariance.returncode == 0, invariance.stdout[-4000:] + invariance.stderr[-2000:]
    ran = set(re.findall(r"(tests/\S+\[\S*foo\S*\]) PASSED", tests.stdout + invariance.stdout))
    # the weights' properties, the gradient's rank and micro-batch invariance and packed against padded
    for test in ("test_aggregation.py::test_every_rule_weighs_responses_alike_however_the_ranks_split_them[foo]",
                 "test_invariance.py::test_gradient_same_for_1_rank_full_batch_and_2_ranks_micro_1[foo]",
                 "test_invariance.py::test_packed_rows_give_the_padded_logprobs_and_gradient[foo]"):
        assert f"tests/{test}" in ran, (test, sorted(ran))

    numbers = run(copy, str(ROOT / "tests" / "rule_numbers.py"), "foo")
    assert numbers.returncode == 0, numbers.stderr[-3000:]
    n = json.loads(numbers.stdout.strip().splitlines()[-1])
    assert n["loss_scale"] == pytest.approx(n["direct"], rel=1e-9) and n["direct"] > 4  # not a mean rule's 1
    assert n["scale_free"] == pytest.approx(0.3 / 1.5)  # over the scale the trainer logged
    assert n["before_metric"].startswith("--agg foo: its loss's scale sum_i w_i L_i depends on more than")
    assert n["token_before_metric"] == pytest.approx(0.3)

    listed = [run(d, "-m", "scripts.reproduce", "--list", timeout=300) for d in (copy, ROOT)]
    assert listed[0].returncode == 0 and listed[0].stdout == listed[1].stdout
    assert "foo" in run(copy, "-m", "scripts.ablation", "--help").stdout  # the fork's rule is one to train
