"""Benchmark-derived (response, reference) cases for the math and code rewards: the reward tests and
scripts/bench_step.py read them.

Each math file of data/benchmarks gives, per row, a response that should score 1 against
its own answer and 0 against a different problem's (different) answer. Where the source has a
worked solution it is the response; otherwise the answer is written in the format the training
sets use (\\boxed{} or DAPO's `Answer:` line).
"""

import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "data" / "benchmarks"
FILES = ["math500", "aime24", "amc23", "gsm8k_test", "dapo_math_17k_sample"]


def response_for(row: dict) -> str:
    sol = row.get("solution")
    if row["source"].startswith("gsm8k") and sol:
        body, _, final = sol.rpartition("####")
        return body + "Answer: " + final.strip()
    if sol and "\\boxed" in sol:
        return sol
    if row["source"].startswith("dapo"):
        return "Let me work through it.\n\nAnswer: " + row["answer"]
    return "Reasoning omitted. The final answer is $\\boxed{" + row["answer"] + "}$."


def cases(name: str, limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (BENCHMARKS / f"{name}.jsonl").read_text().splitlines()]
    rows = rows[:limit] if limit else rows
    return [{"id": r["id"], "response": response_for(r), "answer": r["answer"]} for r in rows]


def code_cases(kind: str) -> tuple[list[str], list[dict]]:
    """(responses, tests) that all pass, for code-reward throughput: "humaneval" (the canonical
    solutions, one sandbox start each, the check outside) or "livecodebench_stdin" (the 175
    stdin/stdout problems, ~2.6 cases each, answered from a table of their cases)."""
    from data.prepare import load_rows

    if kind == "humaneval":
        raw = [json.loads(line) for line in (BENCHMARKS / "humaneval.jsonl").read_text().splitlines()]
        return ([f"```python\n{r['prompt'] + r['canonical_solution']}\n```" for r in raw],
                [{"test": r["test"], "entry_point": r["entry_point"], "prelude": r["prompt"]} for r in raw])
    if kind == "livecodebench_stdin":
        rows = [r for r in load_rows("livecodebench", data_dir=str(BENCHMARKS)) if "stdio" in r["tests"]]
        tables = [{c["input"].strip(): c["output"] for c in r["tests"]["stdio"]} for r in rows]
        return ([f"```python\nimport sys\nT = {t!r}\nsys.stdout.write(T.get(sys.stdin.read().strip(), ''))\n```"
                 for t in tables], [r["tests"] for r in rows])
    raise ValueError(f"unknown code case set {kind!r}")
