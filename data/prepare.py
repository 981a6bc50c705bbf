"""Datasets in one prepared format: JSON Lines rows with
`id`, `source`, `kind` ("math" | "code"), `prompt`, and `answer` (math) or `tests` (code).

`load_rows(spec)` is what the trainer and evaluation call. `spec` is
  demo / demo-test            the offline demo task (data/demo.py),
  a .jsonl / .json / .parquet file already in the prepared format,
  a Hugging Face dataset name that CONVERTERS knows (downloaded through `datasets`).
"""

from __future__ import annotations

import os


def _dapo_math_17k(row: dict, i: int) -> dict:
    # verl format: prompt = [{"role": "user", "content": ...}], reward_model.ground_truth.
    return {
        "id": f"dapo17k/{row.get('extra_info', {}).get('index', i)}",
        "source": "dapo_math_17k",
        "kind": "math",
        "prompt": row["prompt"][0]["content"],  # keeps DAPO's `Answer:` instruction
        "answer": str(row["reward_model"]["ground_truth"]),
    }


def _polaris(row: dict, i: int) -> dict:
    return {
        "id": f"polaris/{i}",
        "source": "polaris",
        "kind": "math",
        "prompt": row["problem"],
        "answer": str(row["answer"]),
    }


CONVERTERS = {
    "BytedTsinghua-SIA/DAPO-Math-17k": _dapo_math_17k,
    "POLARIS-Project/Polaris-Dataset-53K": _polaris,
}


def dedupe(rows: list[dict]) -> list[dict]:
    """Drop repeated prompts (DAPO-Math-17k's published file repeats each one many times)."""
    seen, out = set(), []
    for row in rows:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            out.append(row)
    return out


def load_rows(spec: str) -> list[dict]:
    """Rows of a dataset in the prepared format; raises ValueError with a one-line reason."""
    if spec in ("demo", "demo-test"):
        from data.demo import ensure_demo

        spec = str(ensure_demo() / ("train.jsonl" if spec == "demo" else "test.jsonl"))
    if spec in CONVERTERS:
        import datasets

        convert = CONVERTERS[spec]
        rows = [convert(row, i) for i, row in enumerate(datasets.load_dataset(spec, split="train"))]
        return dedupe(rows)
    if not os.path.exists(spec):
        known = ", ".join(["demo", "demo-test", *CONVERTERS])
        raise ValueError(f"dataset {spec!r} is neither a file nor a known dataset ({known})")
    import datasets

    kind = "parquet" if spec.endswith(".parquet") else "json"
    try:
        rows = list(datasets.load_dataset(kind, data_files=spec, split="train"))
    except Exception as e:  # datasets wraps parse errors in several exception types
        raise ValueError(f"cannot read dataset {spec}: {str(e).splitlines()[0]}") from None
    for i, row in enumerate(rows):
        if not row.get("prompt"):
            raise ValueError(f"{spec}: row {i} has no 'prompt'")
        kind = row.get("kind") or "math"
        row["kind"] = kind
        if kind == "math" and (row.get("answer") is None or str(row["answer"]).strip() == ""):
            raise ValueError(f"{spec}: row {i} has no 'answer' (every math row needs a reference answer)")
        if kind == "code" and not row.get("tests"):
            raise ValueError(f"{spec}: row {i} has no 'tests' (every code row needs tests)")
        row.setdefault("id", f"{os.path.basename(spec)}/{i}")
    return rows
