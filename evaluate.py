"""Evaluate checkpoints by Acc@k and Best@k on math and code benchmarks.

    python evaluate.py --model CKPT --benchmarks aime24,amc23,math500 --n 8
    python evaluate.py --run runs/seq runs/token runs/balanced --benchmarks aime24,amc23,math500 --plot

Acc@k is the mean accuracy of k samples per problem; Best@k the share of problems solved by
at least one of k samples, by the unbiased pass@k estimator 1 - C(n-c, k) / C(n, k) from n
samples with c correct (never a bootstrap). Both are reported for k = 1 and k = n; Acc@1 and
Acc@n have the same expectation (the per-sample accuracy), Best@1 equals them. A sample is
correct when its score is 1: a code answer only when it passes every test, as LiveCodeBench
counts. A benchmark whose tests are all shown in its prompts (MBPP's asserts, LiveCodeBench's
examples without its hidden tests) is marked `*`: a lookup table of the prompt reaches its score.

With --model, one checkpoint; with --run, the initial policy (step 0) and every checkpoint of
each training run (already evaluated ones are skipped) and a table of each run's peak checkpoint
(best average Acc@n) and last step, in the layout of the paper's Table 1, mean ± std over the
seeds of one setting. Samples and scores are cached per
checkpoint under CKPT/eval/<settings>/ as they are made, so a killed evaluation resumes
where it stopped, and every response can be inspected there.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB: one engine, not one per rank as in training
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_grpo  # noqa: E402  (its environment preamble: engines in-process; and the sampling path)
from grpo_utils import checkpoints, common, distributed, engines, flags, run_dir  # noqa: E402
from rewards import SCORING_VERSION  # noqa: E402

PAPER_BENCHMARKS = "aime24,aime25,amc23,math500,minerva,olympiadbench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a Hugging Face checkpoint directory, hub id, or offline policy ('lab')")
    what.add_argument("--run", nargs="+", help="training run directories (with checkpoints/step_*)")
    p.add_argument("--benchmarks", default=PAPER_BENCHMARKS, help="comma-separated names or prepared files")
    p.add_argument("--data-dir", default=None, help="directory with local copies of the benchmark files")
    p.add_argument("--template", default="boxed", choices=["plain", "chat", "boxed", "dapo"])
    p.add_argument("--n", type=int, default=8, help="samples per problem")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=3072)
    p.add_argument("--max-model-len", type=int, default=None, help="default: prompt + max tokens fit the model")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=None,
                   help="engines, each on its own --tensor-parallel-size GPUs, the problems sharded over them "
                        "(default: every visible GPU; 1 on the CPU)")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)  # a data-parallel worker
    p.add_argument("--gpu-memory", type=float, default=0.9)
    p.add_argument("--reward-workers", type=int, default=4)
    p.add_argument("--chunk", type=int, default=256, help="problems generated and cached at a time")
    p.add_argument("--out", default=None, help="where --run writes its table and figures (default: first run)")
    p.add_argument("--plot", action="store_true", help="with --run: accuracy and training-dynamics figures")
    args = p.parse_args(argv)
    args.benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    if not args.benchmarks:
        p.error(f"--benchmarks names none (give comma-separated names or files, e.g. {PAPER_BENCHMARKS})")
    if args.model is not None and not args.model.strip():
        p.error("--model is empty (need a checkpoint dir, a hub id, or demo / lab / lab-nogap)")
    if args.run is not None and not all(r.strip() for r in args.run):
        p.error("--run names an empty directory")
    for k in ("n", "max_tokens", "chunk", "tensor_parallel_size", "reward_workers", "limit", "max_model_len"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be at least 1 (got {getattr(args, k)})"
                    + ("; omit it to evaluate every problem" if k == "limit" else ""))
    try:
        flags.check_finite(args)
    except ValueError as e:
        p.error(str(e))
    if args.temperature < 0 or not 0 < args.top_p <= 1 or not 0 < args.gpu_memory <= 1:
        p.error("--temperature must be >= 0, --top-p in (0, 1] and --gpu-memory in (0, 1]")
    if args.temperature != 0 and not 0.01 <= args.temperature <= 100:  # vLLM raises it to 0.01; 1e39: inf
        p.error(f"--temperature must be 0 (greedy) or in [0.01, 100] (got {args.temperature:g})")
    if args.temperature == 0 and args.n > 1:
        p.error(f"--temperature 0 is greedy: its --n {args.n} samples would all be one; give --n 1, or a temperature "
                "> 0 to sample")
    if not 0 <= args.seed <= flags.SEED_MAX:
        p.error(f"--seed must be in [0, {flags.SEED_MAX}] (vLLM's range; got {args.seed})")
    if args.data_parallel_size is None:
        import torch

        args.data_parallel_size = max(1, torch.cuda.device_count() // args.tensor_parallel_size)
    if args.data_parallel_size < 1:
        p.error("--data-parallel-size must be at least 1")
    return args


# -----------------------------------------------------------------------------
# Metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples is correct) from n samples, c correct."""
    if k > n:
        raise ValueError(f"k={k} > n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def benchmark_metrics(scores: list[list[float]], n: int) -> dict[str, float]:
    """Acc@1, Acc@n, Best@1, Best@n over problems; `scores` holds n scores per problem, a sample
    counting as correct only with score 1 (every test passed)."""
    correct = [sum(s >= 1.0 for s in row) for row in scores]
    acc = sum(c / n for c in correct) / len(scores)
    return {
        "problems": len(scores),
        "acc@1": acc,
        f"acc@{n}": acc,
        "best@1": sum(pass_at_k(n, c, 1) for c in correct) / len(scores),
        f"best@{n}": sum(pass_at_k(n, c, n) for c in correct) / len(scores),
    }


# -----------------------------------------------------------------------------
# One checkpoint


def check_checkpoint(path: str) -> None:
    from safetensors import safe_open

    p = Path(path)
    if p.is_dir():
        has_weights = any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin"))
        if not (p / "config.json").exists() or not has_weights:
            raise ValueError(f"{path}: no model weights (config.json and *.safetensors) in this directory")
        if problem := flags.model_dir_problem(path):  # else vLLM: "The decoder prompt cannot be empty"
            raise ValueError(f"{path}: {problem}")
        for f in sorted(p.glob("*.safetensors")):  # the header covers the whole file: opening a cut one fails
            try:
                with safe_open(str(f), "pt"):
                    pass
            except Exception as e:  # safetensors' own error type
                raise ValueError(f"{f}: damaged weights ({e})") from None
    elif not common.is_hub_id(path):
        raise ValueError(f"{path}: no such checkpoint directory")


# the config keys vLLM reads a model's context from (it takes the shortest, then the tokenizer's model_max_length)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_sequence_length", "max_seq_length", "seq_len")


def context_bound(model: str, args) -> int | None:
    """The most tokens the engine's context can hold for this checkpoint: --max-model-len where given (vLLM
    refuses one above the model's), else the longest of the config's lengths times any RoPE scaling factor,
    never below vLLM's own; None where the config names no length."""
    if args.max_model_len:
        return args.max_model_len
    try:  # a local checkpoint's config.json as it is (check_checkpoint read it); a hub id's through transformers
        if Path(model).is_dir():
            config = json.loads((Path(model) / "config.json").read_text())
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model).to_dict()
    except (OSError, ValueError):  # what the engine makes of it is its own to say: no refusal on a guess
        return None
    lengths = [v for k in CONTEXT_KEYS if isinstance(v := config.get(k), int)]
    if not lengths:
        return None
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    return int(max(lengths) * max(1.0, factor if isinstance(factor, (int, float)) else 1.0))


def check_prompt_room(ckpt: str, tokenizer, benchmarks: dict[str, list[dict]], args) -> None:
    """A benchmark none of whose prompts fits the context beside --max-tokens scores 0 on every problem without
    sampling one answer (sample_checkpoint skips a prompt that leaves no room): refused in one line before the
    engine. Its context is an upper bound (context_bound), so nothing that could run is refused; the prompts
    that the engine's own context leaves out are counted in the table (skipped_notes)."""
    from data.templates import prompt_ids

    context = context_bound(ckpt, args)
    if context is None:
        return
    for name, rows in benchmarks.items():
        lengths = [len(prompt_ids(r, args.template, tokenizer)) for r in rows]
        if not lengths or min(lengths) + args.max_tokens <= context:
            continue
        lo, hi = min(lengths), max(lengths)
        fix = (f"give --max-tokens {context - hi} or less" if hi < context else
               f"give --max-tokens {context - lo} or less (for the shortest)" if lo < context else
               "no --max-tokens fits them: a model with a longer context, or a shorter --template")
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for any prompt of {name} in the {context}-"
                         f"token context of {ckpt} (its prompts need {lo}-{hi} tokens, and every one would score 0): "
                         + fix)


def settings_key(args) -> tuple[str, dict]:
    """The cache key: every setting that changes a score. --max-model-len (a prompt that leaves no room
    for --max-tokens scores 0) only when given, so that the caches made before it counted stay valid."""
    keys = ("template", "n", "temperature", "top_p", "max_tokens", "seed", "limit")
    settings = {k: getattr(args, k) for k in keys}
    settings["scoring"] = SCORING_VERSION  # a cache of other scoring is not read: no table mixes two
    if args.max_model_len is not None:
        settings["max_model_len"] = args.max_model_len
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10], settings


def load_benchmarks(args) -> dict[str, list[dict]]:
    from data.prepare import load_rows

    out = {}
    for name in args.benchmarks:
        rows = load_rows(name, data_dir=args.data_dir, train=False)  # benchmarks as published
        out[Path(name).stem if os.path.exists(name) else name] = rows[: args.limit] if args.limit else rows
    return out


def check_writable(d: Path, what: str) -> None:
    """d (made if missing) takes files: a read-only run is named before the engine starts, not after it."""
    if problem := common.writable_problem(d):
        raise ValueError(f"{d} is not writable ({problem}): {what}")


@contextlib.contextmanager
def appending(path: Path):
    """open(path, "a"), leaving no empty file behind (an engine that failed on the first chunk)."""
    try:
        with open(path, "a") as f:
            yield f
    finally:
        if path.exists() and path.stat().st_size == 0:
            path.unlink()


def cache_dir(ckpt: str, args) -> Path:
    """Where a checkpoint's samples and results for these settings are cached."""
    key = settings_key(args)[0]
    return Path(ckpt) / "eval" / key if Path(ckpt).is_dir() else Path("eval") / ckpt.replace("/", "_") / key


def cached_records(cache: Path, name: str) -> list[dict]:
    """Every cached sample record of a benchmark (one samples file per data-parallel shard); a line cut short
    by a kill is skipped, and redone."""
    recs = []
    for path in sorted(cache.glob(f"{name}.samples*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return recs


def cached_scores(cache: Path, name: str) -> dict[str, list[float]]:
    """Scores by problem id from the cached samples of a benchmark."""
    return {rec["id"]: rec["scores"] for rec in cached_records(cache, name)}


def sample_checkpoint(llm, tokenizer, ckpt: str, benchmarks: dict[str, list[dict]], args) -> None:
    """Sample, score and cache the problems of this process's shard not cached yet."""
    from tqdm import tqdm

    from data.templates import prompt_ids

    cache = cache_dir(ckpt, args)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "settings.json").write_text(json.dumps(settings_key(args)[1], indent=1))
    shard, shards = args.shard or 0, args.data_parallel_size
    for name, rows in benchmarks.items():
        own = cache / (f"{name}.samples.jsonl" if shards == 1 else f"{name}.samples.{shard}of{shards}.jsonl")
        if own.exists():  # drop a last line cut short by a kill
            lines = own.read_text().splitlines()
            own.write_text("".join(x + "\n" for x in lines if _is_json(x)))
        # the seed of problem i is fixed by i alone: any sharding gives the same samples
        todo = shard_todo(ckpt, {name: rows}, args)
        bar = tqdm(total=len(todo), desc=f"{Path(ckpt).name}:{name}", leave=False, disable=args.shard is not None)
        max_len, skipped = llm.llm_engine.model_config.max_model_len, 0
        with appending(own) as f:
            for start in range(0, len(todo), args.chunk):
                chunk = todo[start : start + args.chunk]
                ids = [prompt_ids(r, args.template, tokenizer) for _, r in chunk]
                # A prompt that leaves no room for the answer in the context scores 0 (counted).
                too_long = [len(x) + args.max_tokens > max_len for x in ids]
                for (_, r), skip in zip(chunk, too_long):
                    if skip:
                        rec = {"id": r["id"], "scores": [0.0] * args.n, "skipped": "prompt too long"}
                        f.write(json.dumps(rec) + "\n")
                skipped += sum(too_long)
                chunk = [(i, {**r, "prompt_ids": x}) for (i, r), x, skip in zip(chunk, ids, too_long) if not skip]
                texts, scores = train_grpo.evaluation_samples(
                    llm, [r for _, r in chunk], [i for i, _ in chunk], n=args.n, temperature=args.temperature,
                    top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed, step=0, workers=args.reward_workers)
                for (_, r), txt, sc in zip(chunk, texts, scores):
                    f.write(json.dumps({"id": r["id"], "scores": sc, "responses": txt,
                                        "reference": r.get("answer")}) + "\n")
                f.flush()
                bar.update(len(chunk) + sum(too_long))
        bar.close()
        if skipped:
            print(f"[eval] {name}: {skipped} prompts longer than the context minus --max-tokens scored 0", flush=True)


def shard_todo(ckpt: str, benchmarks: dict[str, list[dict]], args) -> list[tuple[int, dict]]:
    """(index, row) of the problems of this process's shard that have no cached samples yet."""
    cache, shard, shards = cache_dir(ckpt, args), args.shard or 0, args.data_parallel_size
    todo = []
    for name, rows in benchmarks.items():
        done = cached_scores(cache, name)
        todo += [(i, r) for i, r in enumerate(rows) if i % shards == shard and r["id"] not in done]
    return todo


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def checkpoint_results(ckpt: str, benchmarks: dict[str, list[dict]], args) -> dict:
    """Metrics of one checkpoint from its cached samples (all shards); written to results.json."""
    cache = cache_dir(ckpt, args)
    results = {}
    for name, rows in benchmarks.items():
        last = {rec["id"]: rec for rec in cached_records(cache, name)}  # the last record of each problem
        missing = [r["id"] for r in rows if r["id"] not in last]
        if missing:
            raise RuntimeError(f"{ckpt}: {len(missing)} {name} problems have no samples (first: {missing[0]})")
        results[name] = benchmark_metrics([last[r["id"]]["scores"] for r in rows], args.n)
        if skipped := sum(bool(last[r["id"]].get("skipped")) for r in rows):
            results[name]["skipped"] = skipped  # scored 0, no response drawn: said under every table
        if any(r.get("tests_in_prompt") for r in rows):
            results[name]["tests_in_prompt"] = True
    names = list(results)
    n = args.n
    results["average"] = {m: sum(results[b][m] for b in names) / len(names)
                          for m in ("acc@1", f"acc@{n}", "best@1", f"best@{n}")}
    (cache / "results.json").write_text(json.dumps({"checkpoint": str(ckpt), "settings": settings_key(args)[1],
                                                     "results": results}, indent=1))
    return results


TESTS_IN_PROMPT_NOTE = ("* every test is shown in the prompt (MBPP's asserts; LiveCodeBench's examples, its hidden "
                        "tests absent): an upper bound on the official score that a lookup table of the prompt reaches")


def marked(name: str, metrics: dict) -> str:
    return name + "*" if metrics.get("tests_in_prompt") else name


def skipped_notes(results: list[dict], names: list[str]) -> list[str]:
    """Under a table, each benchmark some of whose prompts left no room for --max-tokens in the context: scored
    0 with no response drawn, which its numbers do not show (the most of any checkpoint in the table)."""
    most = {b: max((res[b].get("skipped", 0) for res in results if b in res), default=0) for b in names}
    notes = [f"{b}: {k} of {max(res[b]['problems'] for res in results if b in res)} prompts longer than the context "
            f"minus --max-tokens scored 0, with no response drawn" for b, k in most.items() if k]
    return ["", *notes] if notes else []


def format_table(results: dict, n: int) -> str:
    cols = ["acc@1", f"acc@{n}", "best@1", f"best@{n}"]
    lines = [f"| {'benchmark':<16} | {'problems':>8} | " + " | ".join(f"{c:>7}" for c in cols) + " |",
             "|" + "-" * 18 + "|" + "-" * 10 + "|" + "|".join("-" * 9 for _ in cols) + "|"]
    for name, m in results.items():
        probs = str(m.get("problems", "")) if name != "average" else ""
        lines.append(f"| {marked(name, m):<16} | {probs:>8} | " + " | ".join(f"{100 * m[c]:7.1f}" for c in cols)
                     + " |")
    if any(m.get("tests_in_prompt") for m in results.values()):
        lines.append("\n" + TESTS_IN_PROMPT_NOTE)
    lines += skipped_notes([results], [b for b in results if b != "average"])
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Runs: every checkpoint from the initial policy on, peak vs last, mean ± std over seeds


def run_args(run: str) -> dict:
    """The run's args.json ({} without one); a damaged one is named in one line (run_dir.read_args_json)."""
    return run_dir.read_args_json(run) or {}


def run_checkpoints(run: str) -> list[tuple[int, str]]:
    """(step, checkpoint) of a run: step 0 is the initial policy (the run's --model), then step_N."""
    ckpts = checkpoints.checkpoint_dirs(Path(run, "checkpoints"))  # the trainer's own names: step_ and digits
    if not Path(run).is_dir():
        raise ValueError(f"{run}: no such run directory")
    if not ckpts:
        raise ValueError(f"{run}: no checkpoints (expected {run}/checkpoints/step_N)")
    from data.demo import model_dir

    initial = run_args(run).get("model")
    return ([(0, model_dir(initial))] if initial else []) + [(int(p.name.split("_")[1]), str(p)) for p in ckpts]


def run_label(run: str) -> str:
    agg = run_args(run).get("agg")
    return f"{Path(run).name} ({agg})" if agg and agg not in Path(run).name else Path(run).name


def group_runs(runs: list[str]) -> dict[str, list[str]]:
    """Runs of one setting (the same arguments but the seed) under one label: the arguments that
    differ between the settings ('token', 'lab-nogap balanced'), or each run alone by its name."""
    # what may differ between one run's launches, plus the seed and where it is written (the trainer's parser
    # declares what each flag is to a run)
    train_grpo.arguments()
    same_setting = flags.not_identity() | {"seed", "output_dir"}

    def setting(run: str) -> str:
        a = run_args(run)
        return json.dumps({k: v for k, v in a.items() if k not in same_setting}, sort_keys=True) if a else run

    groups: dict[str, list[str]] = {}
    for run in runs:
        groups.setdefault(setting(run), []).append(run)
    if all(len(g) == 1 for g in groups.values()):
        return {run_label(g[0]): g for g in groups.values()}
    firsts = [run_args(g[0]) for g in groups.values()]
    keys = sorted({k for a in firsts for k in a} - same_setting)
    differ = [k for k in keys if len({json.dumps(a.get(k)) for a in firsts}) > 1]
    differ = sorted(differ, key=lambda k: k != "model")  # e.g. 'lab-nogap token'
    labels = {}
    for g in groups.values():
        a = run_args(g[0])
        # a switch by its name where it is on ('dr-grpo no-std-norm'), by nothing where it is off
        parts = [k.replace("_", "-") if a.get(k) is True else str(a.get(k)) for k in differ
                 if a.get(k) not in (False, None)]
        label = " ".join(parts) or a.get("agg") or Path(g[0]).name
        labels[label if label not in labels else f"{label} ({Path(g[0]).name})"] = g
    return labels


def peak_and_last(per_step: dict[int, dict], n: int) -> dict[str, tuple[int, dict]]:
    """The run's best checkpoint by average Acc@n (over trained checkpoints, step > 0) and its last."""
    trained = [s for s in per_step if s > 0] or list(per_step)
    peak = max(trained, key=lambda s: (per_step[s]["average"][f"acc@{n}"], s))
    return {"peak": (peak, per_step[peak]), "last": (max(per_step), per_step[max(per_step)])}


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    m = sum(values) / len(values)
    return m, (math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0)


def runs_table(per_run: dict[str, dict[int, dict]], groups: dict[str, list[str]], names: list[str], n: int) -> str:
    """Table 1's layout: per setting, the peak and the last checkpoint, mean ± std over its seeds
    (each seed's own peak); the initial policies first, as reference rows."""
    benches = [*names, "average"] if len(names) > 1 else names
    shown = {b: res[b] for r in per_run.values() for res in r.values() for b in names if res[b].get("tests_in_prompt")}
    head = "| run | point | step | " + " | ".join(f"{marked(b, shown.get(b, {}))} Acc@{n} / Best@{n}"
                                                   for b in benches) + " |"
    lines = [head, "|" + "---|" * (3 + len(benches))]

    def row(label: str, point: str, points: list[tuple[int, dict]]) -> str:
        cells = []
        for b in benches:
            acc = mean_std([100 * r[b][f"acc@{n}"] for _, r in points])
            best = mean_std([100 * r[b][f"best@{n}"] for _, r in points])
            cells.append(f"{acc[0]:.1f} / {best[0]:.1f}" if len(points) == 1 else
                         f"{acc[0]:.1f} ± {acc[1]:.1f} / {best[0]:.1f} ± {best[1]:.1f}")
        steps = ", ".join(str(s) for s, _ in points)
        return f"| {label} | {point} | {steps} | " + " | ".join(cells) + " |"

    initial = {run_args(r).get("model"): per_run[r][0] for g in groups.values() for r in g if 0 in per_run[r]}
    for model, res in initial.items():
        lines.append(row(f"initial policy ({model})" if len(initial) > 1 else "initial policy", "-", [(0, res)]))
    for label, runs in groups.items():
        seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
        pl = [peak_and_last(per_run[r], n) for r in runs]
        for point in ("peak", "last"):
            lines.append(row(label + seeds, point, [p[point] for p in pl]))
    if shown:
        lines.append("\n" + TESTS_IN_PROMPT_NOTE)
    lines += skipped_notes([res for r in per_run.values() for res in r.values()], names)
    return "\n".join(lines)


def training_curves(run: str, keys: list[str]) -> dict[str, dict[int, float]]:
    """Per-step training metrics of a run (run_dir.run_metrics), at x = step - 1: the number of
    updates made before the step's rollout, so the initial policy's rollouts are at 0."""
    logged = run_dir.run_metrics(Path(run))
    return {k: {step - 1: m[k] for step, m in sorted(logged.items()) if k in m and step > 0} for k in keys}


def plot_runs(
    per_run: dict[str, dict[int, dict]], groups: dict[str, list[str]], names: list[str], n: int, out: Path
) -> list[Path]:
    """The paper's three figures, each setting's mean over its seeds with a ± std band:
    1. accuracy vs step (from step 0, the initial policy), and peak (solid) vs last (dashed) bars;
    2. the policy-gradient loss over training; 3. response-length CV, negative-positive length
    gap and mean length over training (rollout metrics from each run's metrics.jsonl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def band(ax, curves: list[dict[int, float]], label: str, color) -> None:
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not steps:
            return
        stats = [mean_std([c[s] for c in curves]) for s in steps]
        m = [x for x, _ in stats]
        ax.plot(steps, m, label=label, color=color)
        ax.fill_between(steps, [x - e for x, e in stats], [x + e for x, e in stats], color=color, alpha=0.2)

    colors = {label: f"C{i}" for i, label in enumerate(groups)}
    paths = []
    bench = "average" if len(names) > 1 else names[0]
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    for label, runs in groups.items():
        band(ax, [{s: 100 * r[bench][f"acc@{n}"] for s, r in per_run[run].items()} for run in runs],
             label, colors[label])
    ax.set(title=f"{bench}: Acc@{n} vs step (mean ± std over seeds)", xlabel="step", ylabel=f"Acc@{n} (%)")
    ax.legend(fontsize=8)
    for i, (label, runs) in enumerate(groups.items()):
        pl = [peak_and_last(per_run[r], n) for r in runs]
        for j, (point, style) in enumerate((("peak", dict(fill=True)), ("last", dict(fill=False, linestyle="--")))):
            m, e = mean_std([100 * p[point][1][bench][f"acc@{n}"] for p in pl])
            bars.bar(i + 0.38 * (j - 0.5), m, width=0.36, yerr=e, edgecolor=colors[label], color=colors[label],
                     linewidth=1.5, capsize=3, label=point if i == 0 else None, **style)
    initial = [per_run[r][0][bench][f"acc@{n}"] for g in groups.values() for r in g if 0 in per_run[r]]
    if initial:
        bars.axhline(100 * initial[0], color="grey", linewidth=1, label="initial policy")
    bars.set_xticks(range(len(groups)), list(groups), fontsize=8, rotation=15)
    bars.set(title="peak (solid) and last (dashed)", ylabel=f"Acc@{n} (%)")
    bars.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "figure1_accuracy.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    panels = {"figure2_pg_loss.png": [("loss/pg", "policy-gradient loss")],
              "figure3_length.png": [("length/cv", "response-length CV (within group)"),
                                     ("length/pos_neg_gap", "neg - pos response length (tokens)"),
                                     ("length/mean", "mean response length (tokens)")]}
    for name, tags in panels.items():
        fig, axes = plt.subplots(1, len(tags), figsize=(4.6 * len(tags), 3.4), squeeze=False)
        for label, runs in groups.items():
            curves = [training_curves(r, [t for t, _ in tags]) for r in runs]
            for ax, (tag, _) in zip(axes[0], tags):
                band(ax, [c[tag] for c in curves if c[tag]], label, colors[label])
        for ax, (tag, title) in zip(axes[0], tags):
            ax.set(title=title, xlabel="updates before the rollout (0: initial policy)")
            if tag in ("loss/pg", "length/pos_neg_gap"):
                ax.axhline(0, color="grey", linewidth=0.8)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


# -----------------------------------------------------------------------------


def make_llm(model: str, args):
    import torch
    from transformers import AutoConfig
    from vllm import LLM



    kw = dict(tensor_parallel_size=args.tensor_parallel_size, seed=args.seed)
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if torch.cuda.is_available():
        kw.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_memory)
    else:
        context = args.max_model_len or getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", 4096)
        kw.update(engines.vllm_cpu_kwargs(context))
    return LLM(model=model, **kw)


def sample_all(pending: list[str], benchmarks: dict[str, list[dict]], args) -> None:
    """Sample every pending checkpoint with one engine, swapping the weights in place between them."""
    from transformers import AutoTokenizer



    llm = None
    for ckpt in pending:
        if not shard_todo(ckpt, benchmarks, args):
            continue  # everything of this shard is cached (a resumed evaluation)
        t0 = time.time()
        if llm is None:
            llm = make_llm(ckpt, args)
        else:  # same architecture: swap the weights in place instead of a new engine
            train_grpo.load_weights_into_vllm(llm, weights_path=ckpt)
        sample_checkpoint(llm, AutoTokenizer.from_pretrained(ckpt), ckpt, benchmarks, args)
        print(f"[eval] {ckpt}: sampled{'' if args.shard is None else f' (shard {args.shard})'} "
              f"in {time.time() - t0:.0f}s", flush=True)


def run_shards(args, argv: list[str] | None) -> None:
    """One worker process (this script with --shard i) per engine, each on its own GPUs (or
    cores); they cache their shard's samples, which the caller then merges."""
    import subprocess

    import torch

    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count())))).split(",")
    if torch.cuda.is_available() and len(gpus) < dp * tp:
        sys.exit(f"evaluate.py: error: --data-parallel-size {dp} x --tensor-parallel-size {tp} needs {dp * tp} GPUs, "
                 f"{len(gpus)} visible")
    procs = []
    for i in range(dp):
        env = dict(os.environ)
        if torch.cuda.is_available():
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * tp : (i + 1) * tp])
        cmd = [sys.executable, str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv),
               "--shard", str(i)]
        procs.append(subprocess.Popen(cmd, env=env))
    failed = [i for i, p in enumerate(procs) if p.wait() != 0]
    if failed:
        sys.exit(f"evaluate.py: error: data-parallel worker(s) {failed} failed (see their output above); "
                 "rerun the same command to resume from the cached samples")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.model:
            from data.demo import model_dir

            args.model = model_dir(args.model)
            check_checkpoint(args.model)
            jobs = {None: [(None, args.model)]}
        else:
            jobs = {run: run_checkpoints(run) for run in args.run}
            for ckpts in jobs.values():
                for _, c in ckpts:
                    check_checkpoint(c)
        benchmarks = load_benchmarks(args)
        if any(r["kind"] == "code" for rows in benchmarks.values() for r in rows):
            from rewards import sandbox_mode

            sandbox_mode()  # code rewards fail closed without bubblewrap: say so before the engine starts
        from transformers import AutoTokenizer

        from data.templates import render_prompt

        first = AutoTokenizer.from_pretrained(next(c for ckpts in jobs.values() for _, c in ckpts))
        for rows in benchmarks.values():  # e.g. a chat template asked of a tokenizer without one
            for kind in {r["kind"] for r in rows}:
                render_prompt("", args.template, first, kind)
        for ckpt in dict.fromkeys(ckpts[0][1] for ckpts in jobs.values()):  # a run's checkpoints share one context
            check_prompt_room(ckpt, AutoTokenizer.from_pretrained(ckpt), benchmarks, args)
    except (ValueError, RuntimeError, OSError) as e:
        sys.exit(f"evaluate.py: error: {common.first_line(e)}")

    per_run, results, pending = {}, {}, []  # results and pending by checkpoint
    for ckpts in jobs.values():
        for _, ckpt in ckpts:
            cached = cache_dir(ckpt, args) / "results.json"
            if ckpt in results or ckpt in pending:
                continue  # e.g. the initial policy that several runs share
            if cached.exists() and set(json.loads(cached.read_text())["results"]) >= set(benchmarks):
                results[ckpt] = json.loads(cached.read_text())["results"]
                if args.shard is None:
                    print(f"[eval] {ckpt}: already evaluated ({cached})", flush=True)
            else:
                pending.append(ckpt)
    try:  # where the samples, results and the table go: before the engine starts
        for ckpt in pending:
            check_writable(cache_dir(ckpt, args), "the samples are cached there; make it writable, or evaluate a "
                           "copy of the checkpoint")
        if args.run and args.shard is None:
            check_writable(Path(args.out or args.run[0]), "the table goes there; give another --out")
    except ValueError as e:
        sys.exit(f"evaluate.py: error: {e}")

    if args.shard is not None or args.data_parallel_size == 1:
        import torch

        if args.shard is not None and not torch.cuda.is_available():


            # each CPU engine on its own cores, as ranks are
            distributed.pin_cpu_rank(args.shard, args.data_parallel_size)
        sample_all(pending, benchmarks, args)  # this process's engine
        if args.shard is not None:
            return
    elif pending:
        run_shards(args, argv)
    for ckpt in pending:
        results[ckpt] = checkpoint_results(ckpt, benchmarks, args)
        print(f"[eval] {ckpt}\n{format_table(results[ckpt], args.n)}", flush=True)
        print(f"[eval] results: {cache_dir(ckpt, args) / 'results.json'}", flush=True)
    for run, ckpts in jobs.items():
        per_run[run] = {step: results[ckpt] for step, ckpt in ckpts}

    if args.run:
        names = list(benchmarks)
        groups = group_runs(args.run)
        out = Path(args.out or args.run[0])
        out.mkdir(parents=True, exist_ok=True)
        # a later evaluation with other settings replaces the table: it says which settings it holds
        settings = {**settings_key(args)[1], "benchmarks": ",".join(names)}
        text = "settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + "\n\n" \
            + runs_table(per_run, groups, names, args.n)
        (out / "eval_table.md").write_text(text + "\n")
        (out / "eval_table.json").write_text(json.dumps({"settings": settings, "runs": {
            label: {run: {str(s): r for s, r in per_run[run].items()} for run in runs}
            for label, runs in groups.items()}}, indent=1))
        print(text)
        print(f"[eval] table: {out / 'eval_table.md'}")
        if args.plot:
            paths = plot_runs(per_run, groups, names, args.n, out)
            print("[eval] figures: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
    train_grpo.exit_without_teardown()
