"""data/: conversion of the training and benchmark sets, dedupe, templates."""

import json

import pytest
from conftest import BENCHMARKS

from data.prepare import convert, dedupe, load_rows
from data.templates import DAPO_PREFIX, DAPO_SUFFIX, render_prompt
from rewards import compute_rewards


@pytest.mark.parametrize("name,count,kind", [
    ("aime24", 30, "math"), ("amc23", 40, "math"), ("math500", 500, "math"), ("gsm8k", 1319, "math"),
    ("dapo17k", 106, "math"), ("humaneval", 164, "code"), ("mbpp", 427, "code"), ("livecodebench", 279, "code"),
])
def test_local_benchmark_files_convert(name, count, kind):
    rows = load_rows(name, data_dir=str(BENCHMARKS))
    assert len(rows) == count and {r["kind"] for r in rows} == {kind}
    assert len({r["id"] for r in rows}) == count
    for r in rows:
        assert r["prompt"] and (r["answer"] if kind == "math" else r["tests"])


def test_dapo_rows_keep_the_answer_instruction():
    rows = load_rows("dapo17k", data_dir=str(BENCHMARKS))
    assert all(r["prompt"].startswith(DAPO_PREFIX) and r["prompt"].endswith(DAPO_SUFFIX) for r in rows)
    # the published DAPO file is in verl's chat format with the answer under reward_model
    hf_row = {"prompt": [{"role": "user", "content": rows[0]["prompt"]}],
              "reward_model": {"ground_truth": "34"}, "extra_info": {"index": "abc"}}
    assert convert(hf_row, "dapo17k", 0)["answer"] == "34"


def test_dedupe_drops_repeated_prompts():
    rows = [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 2}, {"prompt": "a", "id": 3}]
    assert [r["id"] for r in dedupe(rows)] == [1, 2]


def test_gsm8k_hub_format_and_olympiad_list_answers():
    assert convert({"question": "q", "answer": "work <<1+1=2>>\n#### 1,450"}, "gsm8k", 0)["answer"] == "1,450"
    assert convert({"question": "q", "final_answer": ["$3$", "$4$"]}, "olympiadbench", 0)["answer"] == "3, 4"
    assert convert({"problem": "q", "answer": 27.0}, "amc23", 0)["answer"] == "27"


def test_mbpp_reference_solutions_pass_their_converted_tests():
    raw = {json.loads(x)["id"]: json.loads(x) for x in (BENCHMARKS / "mbpp_sanitized.jsonl").read_text().splitlines()}
    rows = load_rows("mbpp", data_dir=str(BENCHMARKS))
    responses = ["```python\n" + raw[r["id"]]["code"] + "\n```" for r in rows]
    scores = compute_rewards(responses, [r["tests"] for r in rows], ["code"] * len(rows), num_workers=2)
    assert [r["id"] for r, s in zip(rows, scores) if s != 1.0] == []


def test_livecodebench_functional_tests_run_against_a_solution():
    row = {"problem": "Add a to every element.", "test_type": "functional",
           "starter_code": "class Solution:\n    def addAll(self, a: int, xs: List[int]) -> List[int]:\n        ",
           "tests": [{"input": "2\n[1, 2]", "output": "[3, 4]", "testtype": "functional"},
                     {"input": "0\n[]", "output": "[]", "testtype": "functional"}]}
    tests = convert(row, "livecodebench", 0)["tests"]
    good = "```python\nclass Solution:\n    def addAll(self, a: int, xs: List[int]) -> List[int]:\n" \
           "        return [x + a for x in xs]\n```"
    wrong = good.replace("x + a", "x - a")
    assert compute_rewards([good, wrong], [tests, tests], ["code", "code"], 2) == [1.0, 0.0]


def test_livecodebench_stdin_rows_become_stdio_tests():
    rows = load_rows("livecodebench", data_dir=str(BENCHMARKS))
    stdin = [r for r in rows if "stdio" in r["tests"]]
    assert len(stdin) == 175 and all(set(c) == {"input", "output"} for r in stdin for c in r["tests"]["stdio"])


def test_templates():
    assert render_prompt("What is 1+1?", "plain") == "Question: What is 1+1?\nAnswer:"

    class NoChat:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        render_prompt("x", "boxed", NoChat())
    with pytest.raises(ValueError, match="unknown template"):
        render_prompt("x", "fancy")
