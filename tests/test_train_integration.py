"""A real 2-rank DeepSpeed ZeRO-3 + colocated vLLM run of the trainer for each aggregation rule."""

import glob
import json
import math
import os

import pytest
import torch
from conftest import BENCHMARKS, ROOT, cpu_env, deepspeed_run

STEPS = 3
FLAGS = ["--steps", str(STEPS), "--prompts-per-step", "8", "--group-size", "4", "--micro-batch-size", "4",
         "--lr", "2e-3", "--eval-interval", "100", "--eval-limit", "32", "--eval-samples", "2",
         "--save-interval", "100"]
EXPECTED = ["reward/mean", "reward/accuracy", "loss/pg", "loss/clip_frac", "loss/approx_kl", "loss/grad_norm", "lr",
            "length/mean", "length/max", "length/cv", "length/pos_neg_gap", "groups/zero_var_share",
            "length/truncation_rate", "time/rollout", "time/reward", "time/logprobs", "time/update", "time/sync",
            "perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/update_tflops", "train/micro_batches",
            "loss/token_weight"]
MISMATCH = ["rollout/mismatch_abs", "rollout/mismatch_kl", "rollout/mismatch_out_share", "rollout/correction_mean"]


def hf_greedy(model_dir, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.templates import render_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    for p in prompts:
        ids = tok(render_prompt(p, "plain"), return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


DAPO = ["--dynamic-sampling", "--overlong-buffer", "8"]  # every 7-token demo answer loses 3/8 of its reward


@pytest.mark.slow
@pytest.mark.parametrize("agg,minibatches,correction,loss,extra", [
    ("seq", 1, "none", "ppo", ["--lora-rank", "2"]),  # LoRA: vLLM samples, and the checkpoint holds, the merged policy
    ("token", 2, "token", "gspo", []), ("balanced", 2, "sequence", "sapo", []),
    ("token-batch", 2, "none", "cispo", DAPO)])
def test_two_rank_run(agg, minibatches, correction, loss, extra, demo_dir, tmp_path):
    out = tmp_path / "run"
    if "--lora-rank" in extra:  # with LoRA's KL reference, and ZeRO-3 saying each time it drops its module trace
        cfg = json.loads((ROOT / "ds_config.json").read_text())
        cfg["zero_optimization"]["log_trace_cache_warnings"] = True
        (tmp_path / "ds.json").write_text(json.dumps(cfg))
        extra = [*extra, "--kl-coef", "0.01", "--ds-config", str(tmp_path / "ds.json")]
    res = deepspeed_run(2, "train_grpo.py", "--agg", agg, "--minibatches", str(minibatches), "--output-dir", str(out),
                        "--rollout-correction", correction, "--policy-loss", loss, *extra, *FLAGS, port=29620)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_29620_*")  # no 66 MiB a rank left behind
    assert "deepspeed_shm_comm" not in res.stdout + res.stderr  # the op DeepSpeed says it built and loaded: none
    defaults = {"ppo": "clip_eps_low 0.2, clip_eps_high 0.28", "gspo": "clip_eps_low 0.0003, clip_eps_high 0.0004",
                "sapo": "sapo_tau_pos 1.0, sapo_tau_neg 1.05", "cispo": "clip_eps_low 1.0, clip_eps_high 4.0"}
    assert f"policy loss {loss} ({defaults[loss]})" in res.stdout  # each paper's defaults, said at start
    if "--kl-coef" in extra:
        # ZeRO-3 prefetches by the module order it recorded and drops the record when a pass runs another; LoRA's
        # reference (adapters scaled to zero) runs the policy's modules in their order, so the record is dropped
        # once, when the first training pass outgrows the first (forward-only) record; PEFT's disable_adapter,
        # which skips the adapters, dropped it 7 times in 4 steps of one rank
        assert (res.stdout + res.stderr).count("Invalidate trace cache") == 1, res.stdout[-3000:]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        missing = [k for k in EXPECTED if k not in r]
        assert not missing, missing
        assert all(math.isfinite(r[k]) for k in EXPECTED)
        assert 0 <= r["reward/accuracy"] <= 1 and r["length/mean"] > 0 and r["perf/gen_tokens_per_s"] > 0
        # the ranks' tokens after balance_ranks dealt each mini-batch's groups, and as sampled: max / mean >= 1
        assert 1 <= r["perf/rank_tokens_max_mean"] and 1 <= r["perf/rank_tokens_max_mean_as_sampled"]
        if r["train/no_signal"]:  # no update, so nothing trained and no mismatch measured
            assert r["perf/train_tokens_per_s"] == 0 and not set(MISMATCH) & set(r)
            continue
        # fp32 engines on the CPU: vLLM's log-probs are the trainer's up to rounding, so any
        # correction is a no-op (token weights 1 to 1e-6, no response masked)
        assert r["rollout/mismatch_abs"] < 1e-4 and r["rollout/mismatch_out_share"] == 0
        assert r["rollout/correction_mean"] == pytest.approx(1.0, abs=1e-6)
        assert r["perf/train_tokens_per_s"] > 0 and r["perf/update_tflops"] > 0
        # sum_i w_i L_i, each rank's over its groups and averaged over ranks and updates: 1 for these rules, which
        # take a mean of token terms (token-batch's only over both ranks: each rank's share of the tokens)
        if not r["train/skipped_updates"]:
            assert r["loss/token_weight"] == pytest.approx(1.0, rel=1e-5)
    assert any(not r["train/no_signal"] for r in train)
    if minibatches > 1:  # a second update per rollout uses stored old log-probs: ratios move
        assert any(r["loss/approx_kl"] > 0 for r in train)
    if loss == "gspo":  # its 4e-4 bound clips whole responses of the second mini-batch
        assert any(r["loss/clip_frac"] > 0.05 for r in train)
    if "--dynamic-sampling" in extra:
        for r in train:  # every group trained on has scores that differ; the step is full unless rounds ran out
            assert r["sample/groups"] == 8 or r["sample/rounds"] == 10
            assert r["groups/zero_var_share"] == (0 if r["sample/groups"] else 1) and r["sample/kept_share"] <= 1
            assert r["sample/prompts"] == 8 * r["sample/rounds"] and 0 <= r["sample/accuracy"] <= 1
            # the shaped reward is the verifier's score minus (L - 4) / 8: 3/8 for a 7-token answer
            assert r["reward/mean"] <= r["reward/accuracy"] - 0.3
        assert any(r["sample/rounds"] > 1 for r in train)  # some step needed a second round
    assert (out / "tb").is_dir() and any((out / "tb").iterdir())

    # After the last weight sync, vLLM's greedy output (written by the final evaluation)
    # equals the greedy output of the trainer's weights (the exported checkpoint).
    ckpt = out / "checkpoints" / f"step_{STEPS:06d}"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "tokenizer.json").exists()
    evals = [json.loads(line) for line in (out / "eval" / f"step_{STEPS:06d}.jsonl").read_text().splitlines()]
    prompts = {json.loads(line)["id"]: json.loads(line)["prompt"]
               for line in (demo_dir / "test.jsonl").read_text().splitlines()}
    ids = [e["id"] for e in evals]
    trained = hf_greedy(ckpt, [prompts[i] for i in ids], 12)
    assert [e["greedy"] for e in evals] == trained
    initial = hf_greedy(demo_dir / "model", [prompts[i] for i in ids], 12)
    assert trained != initial  # the weights did move, so the equality above is the sync's doing


@pytest.mark.slow  # three processes importing the trainer: 5-10 s
def test_cpu_ranks_get_their_own_cores():
    """On the CPU each rank (trainer + in-process vLLM engine) runs on its share of the cores with
    as many torch threads; a launcher's OMP_NUM_THREADS (deepspeed --bind_cores_to_rank) wins."""
    import os
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    probe = ("import os, sys, torch, train_grpo; from grpo_utils import distributed; "
             "distributed.pin_cpu_rank(int(sys.argv[1]), int(sys.argv[2])); "
             "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())")

    def pinned(rank, world, **env):
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        out = subprocess.run([sys.executable, "-c", probe, str(rank), str(world)], cwd=ROOT, capture_output=True,
                             text=True, env={**base, **env}, check=True).stdout.strip().splitlines()[-1]
        return out

    per = max(1, len(cores) // 2)
    for rank in range(2):
        mine = cores[rank * per : (rank + 1) * per] if len(cores) >= 2 else cores
        assert pinned(rank, 2) == f"{mine} {len(mine)}"
    # more ranks than cores: they share, round robin
    assert pinned(len(cores) + 1, 2 * len(cores)) == f"{[cores[(len(cores) + 1) % len(cores)]]} 1"
    assert pinned(1, 2, OMP_NUM_THREADS="1") == f"{cores} 1"  # left alone: not pinned to a share


def bad_input(*flags, env=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "train_grpo.py", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("flags,message", [
    (["--agg", "median"], "invalid choice: 'median'"),
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--lora-rank", "-1"], "--lora-rank must be >= 0 (0: full fine-tuning)"),
    (["--model", "./no/such/model"], "no such directory"),
])
def test_bad_flags_fail_in_one_line(flags, message):
    res = bad_input(*flags)
    assert res.returncode != 0
    assert message in res.stderr and "Traceback" not in res.stderr


def test_prompts_not_divisible_by_ranks():
    import os

    res = bad_input("--prompts-per-step", "7", env={**os.environ, "WORLD_SIZE": "2"})
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "--prompts-per-step 7 is not divisible by the 2 ranks" in res.stderr


@pytest.mark.slow  # a trainer process: imports and a DeepSpeed start, 5-10 s
def test_dataset_row_without_answer(demo_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1+1?", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "What is 2+2?"}) + "\n")
    res = bad_input("--dataset", str(data), "--eval-dataset", str(data), "--output-dir", str(tmp_path / "run"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "row 1 has no 'answer'" in res.stderr


@pytest.mark.slow  # a trainer process: imports and a DeepSpeed start, 5-10 s
def test_code_dataset_without_bubblewrap_fails_in_one_line(demo_dir, tmp_path, path_without_bwrap):
    import os

    res = bad_input("--dataset", str(BENCHMARKS / "humaneval.jsonl"), "--max-prompt-len", "480",
                    "--output-dir", str(tmp_path / "run"),
                    env={**os.environ, "PATH": path_without_bwrap})
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "train_grpo.py: error: code rewards run model-written code and need bubblewrap" in res.stderr


@pytest.mark.slow
def test_a_rollout_trainer_mismatch_is_measured_and_masked(demo_dir, tmp_path):
    # From the first sync on (after step 1), vLLM's logits are 3 x the trainer's (tests/fault_train.py):
    # step 1 samples from the engine built from the checkpoint, the control.
    out = tmp_path / "run"
    res = deepspeed_run(2, "tests/fault_train.py", "--agg", "balanced", "--output-dir", str(out), *FLAGS,
                        "--lr", "2e-4", "--rollout-correction", "sequence", "--rollout-correction-cap", "1.05",
                        env=cpu_env(GRPO_FAULT_SCALE_VLLM="3"), port=29621)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"]}
    assert rows[1]["rollout/mismatch_abs"] < 1e-4 and rows[1]["rollout/correction_mean"] == 1.0
    perturbed = [rows[s] for s in (2, 3) if not rows[s]["train/no_signal"]]
    assert perturbed
    for r in perturbed:  # the demo policy is confident: most tokens keep log-probs near 0 either way
        assert r["rollout/mismatch_abs"] > 0.01 and r["rollout/mismatch_kl"] > 1e-3
        assert r["rollout/mismatch_out_share"] > 0.05
        assert r["rollout/correction_mean"] < 1.0  # responses masked: their geometric-mean ratio leaves [1/C, C]
