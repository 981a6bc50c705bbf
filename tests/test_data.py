"""data/: conversion of the training and benchmark sets, dedupe, templates."""

import json

import pytest
from conftest import BENCHMARKS

from data import prepare
from data.prepare import DATASETS, STDIN_INSTRUCTION, convert, dedupe, load_rows
from data.templates import DAPO_PREFIX, DAPO_SUFFIX, TEMPLATES, render_prompt
from rewards import CODE_INSTRUCTION, compute_rewards


@pytest.mark.parametrize("name,count,kind", [
    ("aime24", 30, "math"), ("amc23", 40, "math"), ("math500", 500, "math"), ("gsm8k", 1319, "math"),
    ("dapo17k", 106, "math"), ("humaneval", 164, "code"), ("mbpp", 257, "code"), ("livecodebench", 279, "code"),
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


def test_only_training_sets_are_deduplicated_and_the_count_is_printed(tmp_path, capsys):
    path = tmp_path / "bench.jsonl"
    rows = [{"id": f"q{i}", "problem": "What is 1+1?" if i < 3 else f"What is {i}+1?", "answer": "2"} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(load_rows(str(path))) == 5  # a benchmark: taken as published
    assert capsys.readouterr().out == ""
    assert [r["id"] for r in load_rows(str(path), train=True)] == ["q0", "q3", "q4"]
    assert "2 repeated prompts dropped, 3 unique" in capsys.readouterr().out


def test_repeated_ids_are_refused(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(json.dumps({"id": "x", "problem": f"q{i}", "answer": "1"}) + "\n" for i in range(2)))
    with pytest.raises(ValueError, match="id 'x' appears more than once"):
        load_rows(str(path))


@pytest.mark.parametrize("system", [False, True], ids=["user-only", "with-system"])
def test_training_set_is_deduplicated_in_arrow_before_conversion(tmp_path, monkeypatch, system):
    """DAPO-17k's parquet (1.79M rows, verl chat format) must not become 1.79M Python rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import data.prepare as prepare

    n, unique = 3000, 30
    sys_msg = [{"role": "system", "content": "Be brief."}] if system else []
    prompts = [sys_msg + [{"role": "user", "content": f"{DAPO_PREFIX}What is {i % unique}+1?{DAPO_SUFFIX}"}]
               for i in range(n)]
    table = pa.table({"data_source": ["math_dapo"] * n, "prompt": prompts,
                      "reward_model": [{"ground_truth": str(i % unique + 1), "style": "rule"} for i in range(n)],
                      "extra_info": [{"index": f"uuid-{i}"} for i in range(n)]})
    pq.write_table(table, tmp_path / "dapo.parquet")
    converted = []
    real_convert = prepare.convert
    monkeypatch.setattr(prepare, "convert", lambda row, source, i: converted.append(i) or real_convert(row, source, i))
    rows = load_rows(str(tmp_path / "dapo.parquet"), train=True)
    assert len(rows) == unique and len(converted) == unique  # only the unique rows were ever converted
    assert [r["answer"] for r in rows] == [str(i + 1) for i in range(unique)]
    assert [r["id"] for r in rows] == [f"uuid-{i}" for i in range(unique)]  # DAPO's own index as the id


HUB_IDS = {name: spec["hf"] for name, spec in DATASETS.items() if spec["hf"]}


@pytest.mark.parametrize("name", sorted(HUB_IDS))
def test_hub_ids_load_with_their_own_config_and_split(name, monkeypatch):
    import datasets

    repo, config, split = HUB_IDS[name]
    calls = []

    real = datasets.load_dataset

    def load_dataset(path, name=None, split=None, **kw):
        if path in ("json", "parquet"):  # a local file
            return real(path, name, split=split, **kw)
        calls.append((path, name, split))
        row = {"id": "a", "problem": "What is 1+1?", "answer": "2"} if DATASETS[name_]["kind"] == "math" else \
            {"task_id": "a", "prompt": "def f():\n", "test": "def check(c):\n    pass\n", "entry_point": "f"}
        return datasets.Dataset.from_list([row])

    name_ = name
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert len(load_rows(repo)) == 1  # a hub id always means the hub, with its entry's config and split
    assert calls == [(repo, config, split)]
    shipped = (prepare.SHIPPED_DIR / DATASETS[name]["file"]).exists() and not DATASETS[name].get("train")
    rows = load_rows(name)  # a name: the copy that ships with the project, else the hub
    assert calls == [(repo, config, split)] * (1 if shipped else 2) and (len(rows) > 1) == shipped


def test_local_mbpp_is_the_test_split_like_the_hub():
    rows = load_rows("mbpp", data_dir=str(BENCHMARKS))
    ids = sorted(int(r["id"].rsplit("/", 1)[1]) for r in rows)
    assert len(ids) == 257 and ids[0] >= 11 and ids[-1] <= 510


def test_minerva_answer_comes_from_the_solution():
    row = {"problem": "Find x.", "solution": "So $x = \\boxed{2.5 \\times 10^{3}}$ m. Then \\boxed{7}", "idx": 3}
    assert convert(row, "minerva", 0)["answer"] == "7"
    with pytest.raises(ValueError, match="no 'answer'"):
        convert({"problem": "Find x.", "solution": "no box here"}, "minerva", 0)


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


def test_livecodebench_functional_tuple_counts_as_list():
    row = {"problem": "Pair up.", "starter_code": "class Solution:\n    def pair(self, a: int) -> List[int]:\n",
           "tests": [{"input": "3", "output": "[3, 4]", "testtype": "functional"}]}
    tests = convert(row, "livecodebench", 0)["tests"]
    as_tuple = "```python\nclass Solution:\n    def pair(self, a):\n        return (a, a + 1)\n```"
    wrong = as_tuple.replace("a + 1", "a + 2")
    assert compute_rewards([as_tuple, wrong], [tests, tests], ["code", "code"], 2) == [1.0, 0.0]


def test_rllm_dict_tests():
    row = {"problem": "Echo.", "starter_code": "", "tests": {"inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"]}}
    assert convert(row, "lcb", 0)["tests"] == {"stdio": [{"input": "1\n", "output": "1\n"},
                                                        {"input": "2\n", "output": "2\n"}]}
    with pytest.raises(ValueError, match="row 4 has tests as a dict"):
        convert({**row, "tests": {"fn_name": "f", "inputs": [[1]], "outputs": [1]}}, "lcb", 4)
    with pytest.raises(ValueError, match="row 5 has tests that are not a list"):
        convert({**row, "tests": ["1 2"]}, "lcb", 5)


def test_livecodebench_stdin_rows_become_stdio_tests():
    rows = load_rows("livecodebench", data_dir=str(BENCHMARKS))
    stdin = [r for r in rows if "stdio" in r["tests"]]
    assert len(stdin) == 175 and all(set(c) == {"input", "output"} for r in stdin for c in r["tests"]["stdio"])


def lcb_lite_row(private: list[dict]) -> dict:
    """A row as LiveCodeBench's code_generation_lite ships it, of a shipped problem (lcb/0: the index of
    the second largest element): public tests as JSON, hidden ones pickled, zlib'd and base64'd."""
    import base64
    import pickle
    import zlib

    lcb0 = json.loads((BENCHMARKS / "livecodebench_public.jsonl").read_text().splitlines()[0])
    blob = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    return {"question_title": "Second Best", "question_content": lcb0["problem"], "platform": "atcoder",
            "question_id": "abc365_b", "contest_date": "2024-08-03T00:00:00", "starter_code": "",
            "public_test_cases": json.dumps(lcb0["tests"]), "private_test_cases": blob, "metadata": "{}"}


SECOND_BEST = "```python\nn = int(input())\na = list(map(int, input().split()))\nprint(a.index(sorted(a)[-2]) + 1)\n```"


def lookup_table(row: dict) -> str:
    """An answer from the prompt alone: the statement's "Sample Input k" / "Sample Output k" blocks as a
    table (LiveCodeBench's public tests are these examples)."""
    import re

    text = row["prompt"].replace("\r\n", "\n")
    samples = re.findall(r"Sample Input (\d+)\n\n(.*?)\n\nSample Output \1\n\n(.*?)(?:\n\n|$)", text, re.S)
    table = {" ".join(x.split()): y for _, x, y in samples}
    return ("```python\nimport sys\nT = " + repr(table) +
            "\nsys.stdout.write(T.get(' '.join(sys.stdin.read().split()), ''))\n```")


def test_livecodebench_hidden_tests_are_scored_and_a_table_of_the_prompt_fails_them():
    import random

    rng = random.Random(0)
    private = []
    for _ in range(6):
        a = rng.sample(range(1, 10**9), rng.randint(2, 100))
        private.append({"input": f"{len(a)}\n{' '.join(map(str, a))}\n", "output": f"{a.index(sorted(a)[-2]) + 1}\n",
                        "testtype": "stdin"})
    hidden = convert(lcb_lite_row(private), "livecodebench", 0)
    public = convert({**lcb_lite_row([]), "private_test_cases": ""}, "livecodebench", 0)
    assert len(hidden["tests"]["stdio"]) == 2 + 6 and "tests_in_prompt" not in hidden
    assert len(public["tests"]["stdio"]) == 2 and public["tests_in_prompt"] is True
    table = lookup_table(public)
    assert "4 8 2 5 1" in table and "8 1 2 3 4 5 10 9 11" in table  # both examples, read from the prompt
    scores = compute_rewards([table, table, SECOND_BEST, SECOND_BEST], [public["tests"], hidden["tests"]] * 2,
                             ["code"] * 4, 2)
    assert scores == [1.0, 0.0, 1.0, 1.0]  # the table: full marks on the examples only


def test_hidden_tests_are_unpickled_without_running_anything(tmp_path):
    import base64
    import pickle
    import zlib

    class Boom:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    blob = base64.b64encode(zlib.compress(pickle.dumps(Boom()))).decode()
    with pytest.raises(ValueError, match="row 3 has private_test_cases that cannot be read"):
        convert({**lcb_lite_row([]), "private_test_cases": blob}, "livecodebench", 3)
    assert not (tmp_path / "ran").exists()


def test_tests_shown_in_the_prompt_are_marked():
    """MBPP's prompt lists its asserts, the shipped LiveCodeBench copy holds only the statement's examples."""
    assert all(r.get("tests_in_prompt") for r in load_rows("mbpp", data_dir=str(BENCHMARKS)))
    assert all(r.get("tests_in_prompt") for r in load_rows("livecodebench", data_dir=str(BENCHMARKS)))
    assert not any(r.get("tests_in_prompt") for r in load_rows("humaneval", data_dir=str(BENCHMARKS)))
    shown = [r for r in load_rows("livecodebench", data_dir=str(BENCHMARKS)) if "stdio" in r["tests"]][:30]
    scores = compute_rewards([lookup_table(r) for r in shown], [r["tests"] for r in shown], ["code"] * 30, 2)
    assert sum(scores) >= 29  # a table of the prompt passes (nearly) all of them (174 of 175): an upper bound


class ChatTokenizer:
    chat_template = "<user>{content}</user><assistant>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return self.chat_template.format(content=messages[-1]["content"])


@pytest.mark.parametrize("template", TEMPLATES)
def test_code_rows_never_get_a_math_instruction(template):
    rows = [r for name in ("humaneval", "mbpp", "livecodebench") for r in load_rows(name, data_dir=str(BENCHMARKS))]
    for r in rows:
        text = render_prompt(r["prompt"], template, ChatTokenizer(), r["kind"])
        assert CODE_INSTRUCTION in text and text.count(CODE_INSTRUCTION) == 1
        assert "boxed" not in text.replace(r["prompt"], "") and DAPO_PREFIX not in text and DAPO_SUFFIX not in text
        assert not text.rstrip().endswith("Answer:")
        assert (STDIN_INSTRUCTION in text) == ("stdio" in r["tests"])
        assert (template == "plain") != text.startswith("<user>")
    math_row = render_prompt("What is 1+1?", template, ChatTokenizer(), "math")
    assert CODE_INSTRUCTION not in math_row


def test_templates():
    assert render_prompt("What is 1+1?", "plain") == "Question: What is 1+1?\nAnswer:"

    class NoChat:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        render_prompt("x", "boxed", NoChat())
    with pytest.raises(ValueError, match="unknown template"):
        render_prompt("x", "fancy")
