"""Datasets in one prepared format, shared by train_grpo.py and evaluate.py.

A prepared file is JSON Lines, one problem a row:
    id, source, kind ("math" | "code"), prompt, and answer (math) or tests (code)
`prompt` is the problem as the user asks it; data/templates.py decides how the model sees it.
Code `tests` are what rewards.code_reward takes: {"test", "entry_point"[, "prelude"]} or
{"stdio": [{"input", "output"}, ...]}. A code row whose every test is shown in its prompt (MBPP's
asserts, LiveCodeBench's statement examples when its hidden tests are not there) says so with
`tests_in_prompt: true`: a lookup table of the prompt passes it, and evaluate.py marks its benchmark.

    python -m data.prepare aime24 math500 humaneval              # from the Hugging Face hub
    python -m data.prepare aime24 amc23 --from data/benchmarks  # from local files
    python -m data.prepare dapo17k --from path/to/dapo.parquet --out data/prepared

`load_rows(spec)` accepts a name of DATASETS, a prepared or raw .jsonl/.json/.parquet file,
or any Hugging Face dataset name whose rows `convert` understands, plus "demo"/"demo-test".
Training sets are deduplicated by prompt (DAPO-Math-17k's file repeats each problem ~100
times), in Arrow before any row becomes a Python object, and the count dropped is printed;
benchmarks are taken as published. Ids must be unique: evaluation keys results by id.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pickle
import re
import zlib
from pathlib import Path

from grpo_utils.common import first_line, is_hub_id, writable_problem
from rewards import REFERENCE_KEY

PREPARED_DIR = Path(__file__).resolve().parent / "prepared"
# Benchmark copies that ship with the project (sources and licences in its README): found by name offline.
SHIPPED_DIR = Path(__file__).resolve().parent / "benchmarks"

# name -> kind, Hugging Face (repo, config, split), the file name a local copy goes by, and
# whether it is a training set (deduplicated by prompt). A hub id of this table loads with its entry.
DATASETS: dict[str, dict] = {
    # training sets
    "dapo17k": {"kind": "math", "hf": ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
                "file": "dapo_math_17k_sample.jsonl", "train": True},
    "polaris": {"kind": "math", "hf": ("POLARIS-Project/Polaris-Dataset-53K", None, "train"), "file": "polaris.jsonl",
                "train": True},
    # math benchmarks
    "aime24": {"kind": "math", "hf": ("HuggingFaceH4/aime_2024", None, "train"), "file": "aime24.jsonl"},
    "aime25": {"kind": "math", "hf": ("yentinglin/aime_2025", None, "train"), "file": "aime25.jsonl"},
    "amc23": {"kind": "math", "hf": ("math-ai/amc23", None, "test"), "file": "amc23.jsonl"},
    "math500": {"kind": "math", "hf": ("HuggingFaceH4/MATH-500", None, "test"), "file": "math500.jsonl"},
    "minerva": {"kind": "math", "hf": ("math-ai/minervamath", None, "test"), "file": "minerva.jsonl"},
    "olympiadbench": {"kind": "math", "hf": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
                      "file": "olympiadbench.jsonl"},
    "gsm8k": {"kind": "math", "hf": ("openai/gsm8k", "main", "test"), "file": "gsm8k_test.jsonl"},
    # code benchmarks
    "humaneval": {"kind": "code", "hf": ("openai/openai_humaneval", None, "test"), "file": "humaneval.jsonl"},
    # MBPP's test split is task_ids 11-510 (257 of the 427 sanitized problems); a local copy of
    # every split is cut to it, so that `mbpp` means the same 257 problems everywhere.
    "mbpp": {"kind": "code", "hf": ("google-research-datasets/mbpp", "sanitized", "test"),
             "file": "mbpp_sanitized.jsonl", "task_ids": (11, 510)},
    # LiveCodeBench's hub copy needs its own loader script: prepare it from a JSONL copy with --from,
    # code_generation_lite's own files (public and hidden tests) or rllm's format (problem, starter_code,
    # tests). A file of this name (the copy that ships) holds the public tests only, the statement's examples.
    "livecodebench": {"kind": "code", "hf": None, "file": "livecodebench_public.jsonl", "public_only": True},
}
HF_NAMES = {spec["hf"][0]: name for name, spec in DATASETS.items() if spec["hf"]}

# Imports LiveCodeBench-style solutions take for granted (typing's List, collections, ...).
CODE_PRELUDE = (
    "from typing import *\nfrom collections import *\nimport math, heapq, bisect, itertools, functools, "
    "string, re, collections\n"
)


STDIN_INSTRUCTION = "Read the input from standard input and print the answer to standard output."


class _OnlyStrings(pickle.Unpickler):
    """An unpickler that builds no object but builtin data: a pickle that names any class or function
    (the way a pickle runs code) is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refused: the pickle names {module}.{name}")


def hidden_tests(blob, source: str, i: int) -> list[dict]:
    """LiveCodeBench's private tests as code_generation_lite ships them: a JSON list, or (most rows) that
    JSON as a pickled string, zlib-compressed and base64-encoded, as LiveCodeBench's own loader reads them."""
    if not blob:
        return []
    try:
        tests = json.loads(blob) if isinstance(blob, str) and blob.lstrip().startswith("[") else None
        if tests is None:
            text = _OnlyStrings(io.BytesIO(zlib.decompress(base64.b64decode(blob)))).load()
            tests = json.loads(text) if isinstance(text, str) else None
    except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"{source}: row {i} has private_test_cases that cannot be read ({e})") from None
    if not isinstance(tests, list):
        raise ValueError(f"{source}: row {i} has private_test_cases that are not a list of tests")
    return tests


def convert(row: dict, source: str, i: int) -> dict:
    """One raw row of any supported dataset -> the prepared format (ValueError if unusable)."""
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    rid = row.get("id") or row.get("task_id") or row.get("unique_id") or extra.get("index")
    rid = str(rid) if rid is not None else f"{source}/{i}"
    out = {"id": rid, "source": row.get("source") or source}
    if "entry_point" in row and "test" in row:  # HumanEval
        prompt = f"Complete this function:\n```python\n{row['prompt']}```"
        # The prompt's code (imports, helpers such as `poly` or `is_palindrome`, the documented
        # signature) runs before the response, so an answer that defines only the entry point
        # finds what the tests use; a response without it leaves the docstring-only stub.
        tests = {"test": row["test"], "entry_point": row["entry_point"], "prelude": row["prompt"]}
        return {**out, "kind": "code", "prompt": prompt, "tests": tests}
    if "test_list" in row:  # MBPP
        defined = re.findall(r"^def (\w+)\s*\(", row.get("code", ""), re.M)
        called = re.findall(r"(\w+)\s*\(", " ".join(row["test_list"]))
        entry = next((f for f in called if f in defined), defined[0] if defined else None)
        if entry is None:
            raise ValueError(f"{source}: row {i} has tests but no function to test")
        test = "\n".join(row.get("test_imports") or []) + "\ndef check(candidate):\n"
        name = re.compile(rf"\b{entry}\b")  # the asserts call the function as `candidate`
        test += "".join(f"    {name.sub('candidate', a)}\n" for a in row["test_list"])
        prompt = f"{row.get('prompt') or row.get('text')}\nYour code should pass these tests:\n" + "\n".join(
            row["test_list"])
        return {**out, "kind": "code", "prompt": prompt, "tests": {"test": test, "entry_point": entry},
                "tests_in_prompt": True}
    cases = row.get("tests") or row.get("public_test_cases")
    if cases and ("starter_code" in row or "question_content" in row):  # LiveCodeBench
        cases = json.loads(cases) if isinstance(cases, str) else cases
        # code_generation_lite's rows: the public tests are the statement's examples; the official
        # evaluation also runs the hidden ones
        hidden = hidden_tests(row.get("private_test_cases"), source, i) if "public_test_cases" in row else None
        if isinstance(cases, list) and hidden:
            cases = cases + hidden
        starter = row.get("starter_code") or ""
        problem = row.get("problem") or row.get("question_content")
        if isinstance(cases, dict):  # APPS/TACO style, as rllm ships some rows
            if cases.get("fn_name") or not isinstance(cases.get("inputs"), list) or not isinstance(
                    cases.get("outputs"), list) or len(cases["inputs"]) != len(cases["outputs"]):
                raise ValueError(f"{source}: row {i} has tests as a dict that is not stdin/stdout "
                                 "{'inputs': [...], 'outputs': [...]}; give a list of {input, output, testtype}")
            cases = [{"input": x, "output": y, "testtype": "stdin"} for x, y in zip(cases["inputs"], cases["outputs"])]
        if not isinstance(cases, list) or not all(isinstance(c, dict) and "input" in c and "output" in c
                                                  for c in cases):
            raise ValueError(f"{source}: row {i} has tests that are not a list of {{input, output, testtype}}")
        if all(c.get("testtype", "stdin") == "stdin" for c in cases):
            tests = {"stdio": [{"input": c["input"], "output": c["output"]} for c in cases]}
            prompt = f"{problem}\n\n{STDIN_INSTRUCTION}"
        else:
            method = re.search(r"def (\w+)\(\s*self", starter)
            if not method:
                raise ValueError(f"{source}: row {i} has functional tests but no method in starter_code")
            pairs = [(c["input"], c["output"]) for c in cases]
            # As LiveCodeBench's own harness: a returned tuple counts as the list it equals.
            test = (f"import json\nCASES = {pairs!r}\ndef check(candidate):\n    for args, expected in CASES:\n"
                    "        args = [json.loads(a) for a in args.split('\\n')]\n"
                    f"        got = getattr(candidate(), {method.group(1)!r})(*args)\n"
                    "        assert (list(got) if isinstance(got, tuple) else got) == json.loads(expected)\n")
            tests = {"test": test, "entry_point": "Solution", "prelude": CODE_PRELUDE}
            prompt = f"{problem}\n\nComplete this starter code:\n```python\n{starter}\n```"
        shown = {"tests_in_prompt": True} if hidden == [] else {}  # code_generation_lite's row without its hidden tests
        return {**out, "kind": "code", "prompt": prompt, "tests": tests, **shown}
    # math
    prompt = row.get("prompt")
    if isinstance(prompt, list):  # verl/DAPO chat format
        prompt = prompt[-1]["content"]
    prompt = prompt or row.get("problem") or row.get("question") or row.get("Problem")
    answer = row.get("reward_model", {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
    for key in ("answer", "final_answer", "Answer", "ground_truth"):
        if answer is None or answer == "":
            answer = row.get(key)
    if (answer is None or answer == "") and isinstance(row.get("solution"), str):
        from rewards import last_boxed  # Minerva as Qwen2.5-Math ships it: the answer is in the solution

        answer = last_boxed(row["solution"])
    if isinstance(answer, list):  # OlympiadBench: a list of final answers
        answer = ", ".join(str(a).strip("$") for a in answer)
    if isinstance(answer, str) and "####" in answer:  # GSM8K's raw answer field
        answer = answer.rpartition("####")[2]
    if not prompt:
        raise ValueError(f"{source}: row {i} has no problem text (prompt/problem/question)")
    if answer is None or str(answer).strip() == "":
        raise ValueError(f"{source}: row {i} has no 'answer' (every math row needs a reference answer)")
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    return {**out, "kind": "math", "prompt": prompt, "answer": str(answer).strip()}


def dedupe(rows: list[dict], source: str = "") -> list[dict]:
    """Drop repeated prompts of a training set, keeping the first; says how many were dropped."""
    seen, out = set(), []
    for row in rows:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            out.append(row)
    if len(out) < len(rows) and source:
        print(f"[data] {source}: {len(rows) - len(out)} repeated prompts dropped, {len(out)} unique", flush=True)
    return out


def _prompt_keys(table):
    """One string per row of an Arrow table, equal for equal prompts, computed chunk by chunk in
    Arrow (no row becomes a Python object); None when the prompt column has another shape."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = next((c for c in ("prompt", "problem", "question", "Problem") if c in table.column_names), None)
    if col is None:
        return None
    column = table.column(col)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column
    if not (pa.types.is_list(column.type) and pa.types.is_struct(column.type.value_type)
            and column.type.value_type.get_field_index("content") >= 0):
        return None
    keys = []
    for chunk in column.chunks:  # chat format (verl/DAPO): the messages' contents
        contents = pc.struct_field(pc.list_flatten(chunk), "content")
        if pc.all(pc.equal(pc.list_value_length(chunk), 1)).as_py():  # one message a row: the keys, no copy
            keys.append(contents)
        else:
            offsets = pc.subtract(chunk.offsets, chunk.offsets[0])
            keys.append(pc.binary_join(pa.ListArray.from_arrays(offsets, contents), "\n"))
    return pa.chunked_array(keys, pa.string())


def _dedupe_arrow(ds, source: str):
    """The first row of every distinct prompt of a `datasets.Dataset`, selected in Arrow."""
    import pyarrow as pa

    keys = _prompt_keys(ds.data.table)
    if keys is None:
        return ds
    rows = pa.chunked_array([pa.array(range(len(keys)), pa.int64())])
    first = pa.table({"k": keys, "i": rows}).group_by("k", use_threads=False).aggregate([("i", "min")])
    keep = sorted(first.column("i_min").to_pylist())
    if len(keep) < len(ds):
        print(f"[data] {source}: {len(ds) - len(keep)} repeated prompts dropped, {len(keep)} unique", flush=True)
    return ds.select(keep)


ROW_EXAMPLE = '{"prompt": "What is 1+1?", "answer": "2"}'


def _check_text(path: str) -> None:
    """A JSON file is UTF-8, and a .jsonl one JSON object per line: the error names the line and what was
    expected (the loader behind it names neither)."""
    data = Path(path).read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - data.rfind(b"\n", 0, e.start)
        raise ValueError(f"dataset {path} line {line}: byte {data[e.start]:#04x} at column {column} is not UTF-8; "
                         "expected UTF-8 text (re-save the file as UTF-8)") from None
    if not path.endswith(".jsonl"):
        return
    for i, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"dataset {path} line {i}: not JSON ({e.msg}, column {e.colno}); expected one JSON "
                             f"object per line, e.g. {ROW_EXAMPLE}") from None
        if not isinstance(row, dict):
            raise ValueError(f"dataset {path} line {i}: a JSON {type(row).__name__}, not an object; expected one "
                             f"JSON object per line, e.g. {ROW_EXAMPLE}")


def _read_file(path: str):
    import datasets

    datasets.disable_progress_bars()
    if not path.endswith((".jsonl", ".json", ".parquet")):
        raise ValueError(f"dataset {path}: not a file format read here; expected .jsonl (one JSON object per line, "
                         f"e.g. {ROW_EXAMPLE}), .json or .parquet")
    kind = "parquet" if path.endswith(".parquet") else "json"
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ValueError(f"dataset {path} is empty")
    if kind == "json" and os.path.isfile(path):
        _check_text(path)
    try:
        return datasets.load_dataset(kind, data_files=path, split="train")
    except Exception as e:  # datasets wraps parse errors in several exception types
        raise ValueError(f"cannot read dataset {path}: {first_line(e)}") from None


def _read_hub(repo: str, config: str | None, split: str):
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(repo, config, split=split)
    except Exception as e:
        raise ValueError(f"cannot load {repo} ({config or 'default'}, {split}) from the Hugging Face hub: "
                         f"{first_line(e)}") from None


def _is_prepared(row: dict) -> bool:
    return row.get("kind") in REFERENCE_KEY and "prompt" in row and any(k in row for k in REFERENCE_KEY.values())


def rows_from(raw, source: str, train: bool = False) -> list[dict]:
    """Prepared rows from raw ones (a list of dicts or a `datasets.Dataset`).

    train: deduplicate by prompt (in Arrow first when `raw` is a Dataset). Raises ValueError
    on unusable rows and on repeated ids.
    """
    if train and hasattr(raw, "data"):
        raw = _dedupe_arrow(raw, source)
    out = []
    for i, row in enumerate(raw):
        if "prompt" in row and "kind" in row and row["kind"] not in REFERENCE_KEY:
            raise ValueError(f"{source}: row {i} is of kind {row['kind']!r}, which rewards.KINDS does not declare "
                             f"({', '.join(REFERENCE_KEY)})")
        if _is_prepared(row):
            tests = row.get("tests")
            key = REFERENCE_KEY[row["kind"]]
            if row.get(key) is None or str(row[key]).strip() in ("", "{}", "[]"):
                raise ValueError(f"{source}: row {i} has no '{key}' (every {row['kind']} row needs its {key})")
            out.append({**row, "id": str(row.get("id") or f"{source}/{i}"),
                        "tests": json.loads(tests) if isinstance(tests, str) else tests})
        else:
            out.append(convert(row, source, i))
    if not out:
        raise ValueError(f"{source}: no rows")
    if train:
        out = dedupe(out, source)
    seen: set[str] = set()
    for row in out:
        if row["id"] in seen:
            raise ValueError(f"{source}: id {row['id']!r} appears more than once; ids must be unique "
                             "(evaluation keys results by id)")
        seen.add(row["id"])
    return out


def _check_kind(rows: list[dict], name: str, origin) -> list[dict]:
    """Rows of a DATASETS name must be of its kind: e.g. HumanEval's file prepared as math500 is refused."""
    want = DATASETS[name]["kind"] if name in DATASETS else None
    wrong = sum(r["kind"] != want for r in rows) if want else 0
    if wrong:
        raise ValueError(f"{origin}: {wrong} of {len(rows)} rows are not {want} problems, but {name} is a {want} "
                         "dataset: is it the right file?")
    return rows


def _task_range(rows: list[dict], spec: dict) -> list[dict]:
    lo, hi = spec.get("task_ids", (None, None))
    if lo is None:
        return rows
    task_id = lambda r: str(r["id"]).rsplit("/", 1)[-1]  # noqa: E731  ("mbpp/11" or 11)
    return [r for r in rows if not task_id(r).isdigit() or lo <= int(task_id(r)) <= hi]


def load_rows(spec: str, data_dir: str | None = None, train: bool | None = None) -> list[dict]:
    """Rows of a dataset in the prepared format; raises ValueError with a one-line reason.

    A name of DATASETS is looked for as data_dir/<file> (if data_dir is given, it must exist),
    then data/prepared/<name>.jsonl, then the copy shipped in data/benchmarks (benchmarks only: a
    training set is never silently replaced by its sample), and is otherwise loaded from the hub
    with its entry's config and split, as is its hub id.
    train: deduplicate prompts (default: as DATASETS says; False for files and other names).
    """
    if spec in ("demo", "demo-test"):
        from data.demo import ensure_demo

        spec = str(ensure_demo() / ("train.jsonl" if spec == "demo" else "test.jsonl"))
    from_hub = spec in HF_NAMES  # a hub id this table knows: loaded with its entry's config and split
    name = HF_NAMES.get(spec, spec)
    if name in DATASETS:
        entry = DATASETS[name]
        dedup = entry.get("train", False) if train is None else train
        if data_dir and not Path(data_dir).is_dir():
            raise ValueError(f"--data-dir {data_dir}: no such directory")
        local = [Path(data_dir) / entry["file"]] if data_dir else []
        local.append(PREPARED_DIR / f"{name}.jsonl")
        if not entry.get("train"):
            local.append(SHIPPED_DIR / entry["file"])
        path = None if from_hub else next((p for p in local if p.exists()), None)
        if path is None and entry["hf"] is None:
            raise ValueError(f"{name}: no local copy found ({', '.join(map(str, local))}); prepare it with --from")
        raw = _read_file(str(path)) if path else _read_hub(*entry["hf"])
        rows = _check_kind(_task_range(rows_from(raw, name, dedup), entry), name, path or entry["hf"][0])
        if path is not None and path.name == entry["file"] and entry.get("public_only"):
            rows = [{**r, "tests_in_prompt": True} for r in rows]
        return rows
    if os.path.exists(spec):
        return rows_from(_read_file(spec), Path(spec).stem, bool(train))
    if is_hub_id(spec):  # another hub dataset: its train split
        return rows_from(_read_hub(spec, None, "train"), spec, bool(train))
    known = ", ".join(["demo", "demo-test", *DATASETS])
    raise ValueError(f"unknown dataset {spec!r}: not a file, not a hub name, not one of {known}")


def main() -> None:
    p = argparse.ArgumentParser(description="Convert datasets to the prepared JSON Lines format.")
    p.add_argument("names", nargs="+", help=f"any of {', '.join(DATASETS)}, or a hub dataset name")
    p.add_argument("--from", dest="source", default=None,
                   help="a local file (one name) or a directory holding the DATASETS file names")
    p.add_argument("--out", default=str(PREPARED_DIR))
    args = p.parse_args()
    if args.source and not os.path.exists(args.source):  # load_rows would name its own --data-dir
        raise SystemExit(f"prepare: error: --from {args.source}: no such file or directory")
    if problem := writable_problem(args.out):
        raise SystemExit(f"prepare: error: --out {args.out} is not writable ({problem})")
    for name in args.names:
        try:
            if args.source and os.path.isfile(args.source):
                raw = _read_file(args.source)
                entry = DATASETS.get(name, {})
                rows = _check_kind(_task_range(rows_from(raw, name, entry.get("train", False)), entry), name,
                                   args.source)
            else:
                raw = None
                rows = load_rows(name, data_dir=args.source)
        except ValueError as e:
            raise SystemExit(f"prepare: error: {e}") from None
        dest = Path(args.out) / f"{name.replace('/', '_')}.jsonl"
        with open(dest, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        read = f"{len(raw)} read, " if raw is not None else ""
        kinds = ", ".join(f"{sum(r['kind'] == k for r in rows)} {k}" for k in REFERENCE_KEY)
        print(f"{name}: {read}{len(rows)} rows ({kinds}) -> {dest}")


if __name__ == "__main__":
    main()
