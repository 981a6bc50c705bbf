"""Real-length inputs end to end on the CPU, with the real vLLM and DeepSpeed: training on a mix of
MATH-500, the DAPO sample (dapo template), LiveCodeBench (stdin and functional), HumanEval and
MBPP, and evaluation over six benchmarks in one call, at batch sizes whose prompt tokens exceed
vLLM's batch token budget (4096 on the CPU), where seeded sampling used to crash."""

import json
import subprocess
import sys

import pytest
from conftest import BENCHMARKS, ROOT, deepspeed_run

from data.prepare import load_rows
from data.templates import render_prompt

MIX = {"math500": 8, "dapo17k": 8, "humaneval": 4, "mbpp": 4, "livecodebench": 8}


def mixed_dataset(path, tokenizer, max_len: int) -> list[dict]:
    rows = []
    for name, n in MIX.items():
        fits = [r for r in load_rows(name, data_dir=str(BENCHMARKS))
                if len(tokenizer(render_prompt(r["prompt"], "dapo", tokenizer, r["kind"]))["input_ids"]) <= max_len]
        if name == "livecodebench":  # both kinds of its tests
            fits = [r for r in fits if "stdio" in r["tests"]][: n // 2] + [r for r in fits if "stdio" not in r["tests"]]
        rows += fits[:n]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.slow
def test_train_on_real_length_prompts(long_demo_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(long_demo_model)
    rows = mixed_dataset(tmp_path / "mix.jsonl", tok, 2000)
    assert {r["kind"] for r in rows} == {"math", "code"} and len(rows) == sum(MIX.values())
    prompt_tokens = sum(len(tok(render_prompt(r["prompt"], "dapo", tok, r["kind"]))["input_ids"]) for r in rows)
    assert prompt_tokens / len(rows) * 8 * 4 > 4096  # one rank's rollout: 8 prompts x G=4 exceed the budget
    out = tmp_path / "run"
    res = deepspeed_run(2, "train_grpo.py", "--model", str(long_demo_model), "--dataset", str(tmp_path / "mix.jsonl"),
                        "--eval-dataset", str(tmp_path / "mix.jsonl"), "--template", "dapo", "--agg", "balanced",
                        "--max-prompt-len", "2000", "--max-response-len", "16", "--steps", "2",
                        "--prompts-per-step", "16", "--group-size", "4", "--minibatches", "2",
                        "--micro-batch-size", "4", "--lr", "1e-4", "--lr-warmup-steps", "2", "--eval-interval", "2",
                        "--eval-limit", "16", "--eval-samples", "2", "--save-interval", "100",
                        "--kl-coef", "0.01",  # a KL term: the update runs even where no group has reward variance
                        "--rollout-correction", "token",
                        "--code-reward", "fraction",  # the code rows' partial credit, on request
                        "--reward-workers", "2", "--output-dir", str(out), port=29640, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"[grpo] {len(rows)} training prompts (0 too long" in res.stdout
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # warm-up over 2 steps x 2 mini-batches: the first update already steps with lr / 4, and the
    # schedule moves with the updates made (none in a step whose groups all have equal rewards)
    updates_before_2 = 0 if metrics[1]["train/no_signal"] else 2
    assert [m["lr"] for m in metrics[1:]] == pytest.approx([1e-4 / 4, 1e-4 * (updates_before_2 + 1) / 4])
    for m in metrics[1:]:  # backward and step through real-length sequences, each step, with the KL reference
        assert m["train/no_signal"] == 0 and m["loss/grad_norm"] > 0 and m["loss/ref_kl"] >= 0
        assert m["reward/errors"] == 0 and m["reward/timeouts"] == 0 and m["length/mean"] > 0
        # vLLM's sampled-token log-probs against the trainer's on prompts of up to 2000 tokens (fp32 on the
        # CPU: rounding only), and the token correction a no-op there; the update's model FLOPs counted
        assert m["rollout/mismatch_abs"] < 1e-4 and m["rollout/correction_mean"] == pytest.approx(1.0, abs=1e-5)
        assert m["perf/update_tflops"] > 0 and m["perf/train_tokens_per_s"] > 0
    evals = [json.loads(x) for x in (out / "eval" / "step_000002.jsonl").read_text().splitlines()]
    assert {e["id"] for e in evals} >= {r["id"] for r in rows[:16]} - {None}


@pytest.mark.slow
def test_evaluate_six_benchmarks_in_one_call(long_demo_model):
    names = "math500,aime24,amc23,humaneval,mbpp,livecodebench"
    res = subprocess.run([sys.executable, "evaluate.py", "--model", str(long_demo_model), "--benchmarks", names,
                          "--data-dir", str(BENCHMARKS), "--template", "boxed", "--n", "2", "--max-tokens", "16",
                          "--limit", "8", "--reward-workers", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    cache = next((long_demo_model / "eval").iterdir())
    results = json.loads((cache / "results.json").read_text())["results"]
    assert set(results) == {*names.split(","), "average"}
    for name in names.split(","):
        assert results[name]["problems"] == 8
        samples = [json.loads(x) for x in (cache / f"{name}.samples.jsonl").read_text().splitlines()]
        assert len(samples) == 8 and all(len(s["scores"]) == 2 for s in samples)
    lcb = {json.loads(x)["id"] for x in (cache / "livecodebench.samples.jsonl").read_text().splitlines()}
    lcb_rows = [r for r in load_rows("livecodebench", data_dir=str(BENCHMARKS)) if r["id"] in lcb]
    assert {"stdio" in r["tests"] for r in lcb_rows} == {True, False}  # stdin and functional rows both ran


def test_eval_seeds_are_per_prompt_and_independent_of_the_ranks():
    from train_grpo import sampling_params

    def seeds(indices) -> list[int]:
        return [p.seed for p in sampling_params(4, 1.0, 1.0, 8, 0, 10, indices)]

    one_rank = seeds(range(0, 12))
    two_ranks = {}
    for rank in (0, 1):  # rank r holds prompts r, r + 2, ... (train_grpo.evaluate_held_out's sharding)
        two_ranks.update(zip(range(rank, 12, 2), seeds(range(rank, 12, 2))))
    assert len(set(one_rank)) == 12 and one_rank == [two_ranks[i] for i in range(12)]
    seeds = [s + j for s in one_rank for j in range(4)]  # vLLM gives sample j of a request seed + j
    assert len(set(seeds)) == 48
