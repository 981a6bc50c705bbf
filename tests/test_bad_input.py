"""Bad input of every entry point (train_grpo.py, evaluate.py, ablation.py, data.prepare) fails in one
line that states the rule, before any engine starts; run directories are never lost or rewritten by a
launch that trains nothing. No engine starts in this file (the quick tier)."""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import BENCHMARKS, ENVIRON, ROOT, check_args, check_output_dir, cpu_env

import grpo_utils.flags
import train_grpo
from grpo_utils import engines, run_dir
from grpo_utils.checkpoints import checkpoint_dirs, resume_point
from grpo_utils.flags import before_flag, declare, flag_roles, flags_with, not_identity, run_identity


def run(script: str, *args: str, env=None, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(["-m", script] if "." in script and not script.endswith(".py") else [script]), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or cpu_env())


def one_line_error(res: subprocess.CompletedProcess, message: str) -> None:
    assert res.returncode != 0, res.stdout[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], res.stderr[-2000:]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.jsonl").write_text("")
    (d / "a_file").write_text("x")
    (d / "list.json").write_text("[1, 2]")
    (d / "no_model").mkdir()
    weights = d / "cut"
    from data.demo import model_dir

    shutil.copytree(model_dir("demo"), weights)
    data = (weights / "model.safetensors").read_bytes()
    (weights / "model.safetensors").write_bytes(data[: len(data) // 2])
    return d


# flag ranges: checked in the process (what the command line runs first, before any import of an engine)
RANGES = [
    (["--minibatches", "0"], "--minibatches must be at least 1 (got 0)"),
    (["--minibatches", "-1"], "--minibatches must be at least 1 (got -1)"),
    (["--lr=-1e-4"], "--lr must be in (0, 1] (got -0.0001)"),
    (["--lr", "1e300"], "--lr must be in (0, 1] (got 1e+300)"),  # finite, and 40 lines after step 0's evaluation
    (["--lr", "inf"], "--lr must be a finite number (got inf)"),
    (["--kl-coef", "nan"], "--kl-coef must be a finite number (got nan)"),  # NaN passed `>= 0`: no KL, no word
    (["--clip-eps-high", "nan"], "--clip-eps-high must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0"),
    (["--seed", "-1"], "--seed must be in [0, 2147483647] (vLLM's range) (got -1)"),
    (["--seed", str(2**32)], "--seed must be in [0, 2147483647]"),
    (["--keep-last", "0"], "--keep-last must be at least 1 (got 0)"),
    (["--save-interval", "0"], "--save-interval must be at least 1"),
    (["--eval-interval", "0"], "--eval-interval must be at least 1"),
    (["--eval-limit", "0"], "--eval-limit must be at least 1"),
    (["--eval-samples", "0"], "--eval-samples must be at least 1"),
    (["--top-p", "2"], "--top-p must be in (0, 1] (got 2.0)"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--kl-coef", "-0.1"], "--kl-coef must be >= 0 (got -0.1)"),
    (["--max-response-len", "0"], "--max-response-len must be at least 1"),
    (["--clip-eps-low", "1.5"], "--clip-eps-low must be in [0, 1)"),
    (["--vllm-gpu-memory", "1.5"], "--vllm-gpu-memory must be in (0, 1)"),
    (["--model", ""], "--model is empty"),
    (["--clip-eps-low", "1"], "--clip-eps-low must be in [0, 1) (got 1.0)"),
    (["--policy-loss", "cispo", "--clip-eps-low", "1.1"], "--clip-eps-low must be in [0, 1] (got 1.1)"),
    (["--policy-loss", "sapo", "--clip-eps-high", "0.3"],
     "--clip-eps-high does not apply to --policy-loss sapo (its parameters: --sapo-tau-pos, --sapo-tau-neg)"),
    (["--sapo-tau-neg", "1"], "--sapo-tau-neg does not apply to --policy-loss ppo"),
    (["--policy-loss", "sapo", "--sapo-tau-pos", "0"], "--sapo-tau-pos must be > 0 (got 0.0)"),
    (["--max-sample-rounds", "0"], "--max-sample-rounds must be at least 1 (got 0)"),
    (["--overlong-buffer", "4000"], "--overlong-buffer must be at most --max-response-len (got 4000)"),
    (["--overlong-penalty=-1"], "--overlong-penalty must be >= 0 (got -1.0)"),
    # a flag that does nothing without another: refused, as a loss's parameter given to another loss is
    (["--overlong-penalty", "2"], "--overlong-penalty has no effect without --overlong-buffer N"),
    # finite in float64, not in the float32 they reach: once 16 lines of traceback after step 0's evaluation
    (["--overlong-penalty", "1e300", "--overlong-buffer", "12"],  # once the 0/1 scores vanished: no signal
     "--overlong-penalty must be in [0, 10000] (got 1e+300): the 0/1 scores must not vanish next to it"),
    (["--clip-eps-high", "1e300"], "--clip-eps-high must be in [0, 10000] (got 1e+300)"),
    (["--rollout-correction-cap", "1e300"], "--rollout-correction-cap must be in [1, 10000] (got 1e+300)"),
    (["--policy-loss", "sapo", "--sapo-tau-neg", "1e39"], "--sapo-tau-neg must be in [0.001, 1000] (got 1e+39)"),
    (["--policy-loss", "sapo", "--sapo-tau-pos", "1e-300"], "--sapo-tau-pos must be in [0.001, 1000]"),
    (["--kl-coef", "1e300"], "--kl-coef must be in [0, 10000]"),
    (["--weight-decay", "1e300"], "--weight-decay must be < 1 / --lr (AdamW scales the weights by 1 - lr x"),
    (["--temperature", "1e-3"], "--temperature must be in [0.01, 100] (got 0.001): vLLM samples at 0.01 below"),
    (["--temperature", "1e300"], "--temperature must be in [0.01, 100]"),
    (["--peak-tflops", "1e300"], "--peak-tflops must be in [0, 1e+06]"),  # peak x 1e12 = inf: MFU 0
    # once full fine-tuning with no word, alpha in the run's identity
    (["--lora-alpha", "8"], "--lora-alpha scales LoRA's adapters, which only --lora-rank R > 0 adds"),
    # once 5.9e9 adapter parameters on the demo, out of memory
    (["--lora-rank", "1000000"], "--lora-rank must be at most the model's hidden size, 128 (got 1000000)"),
    (["--model", "lab-check", "--lora-rank", "129"], "--lora-rank must be at most the model's hidden size, 128"),
]


def test_each_policy_loss_gets_its_papers_defaults_unless_a_flag_is_given():
    args = {loss: train_grpo.parse_args(["--policy-loss", loss]) for loss in ("ppo", "gspo", "cispo", "sapo")}
    assert (args["ppo"].clip_eps_low, args["ppo"].clip_eps_high) == (0.2, 0.28)
    assert (args["gspo"].clip_eps_low, args["gspo"].clip_eps_high) == (3e-4, 4e-4)
    assert (args["cispo"].clip_eps_low, args["cispo"].clip_eps_high) == (1.0, 4.0)
    assert (args["sapo"].sapo_tau_pos, args["sapo"].sapo_tau_neg, args["sapo"].clip_eps_low) == (1.0, 1.05, None)
    assert train_grpo.parse_args(["--policy-loss", "gspo", "--clip-eps-high", "1e-3"]).clip_eps_high == 1e-3
    for a in args.values():
        check_args(a, world=1)


@pytest.mark.parametrize("flags,message", RANGES, ids=[" ".join(f) for f, _ in RANGES])
def test_trainer_flag_ranges(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_args(train_grpo.parse_args(flags), world=1)


def float_flags() -> list[str]:
    """Every float-typed flag of the trainer's parser, whoever added it."""
    import argparse
    from unittest import mock

    parsers, parse = [], argparse.ArgumentParser.parse_args

    def spy(self, *a, **kw):
        parsers.append(self)
        return parse(self, *a, **kw)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", spy):
        train_grpo.parse_args([])
    return [a.option_strings[0] for a in parsers[-1]._actions if a.type is float]


def test_every_float_flag_must_be_finite():
    flags = float_flags()
    assert {"--lr", "--weight-decay", "--temperature", "--rollout-correction-cap", "--peak-tflops"} <= set(flags)
    for flag in flags:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(ValueError, match=re.escape(f"{flag} must be a finite number")):
                check_args(train_grpo.parse_args([f"{flag}={value}"]), world=1)


def test_a_float_flags_bounds_are_declared_beside_it(monkeypatch):
    # a fork's float flag with bounds=(...) in its a(...) line is checked against them, with nothing else edited
    build = train_grpo.arguments
    for table in ("_DECLARED", "_BOUNDS"):
        monkeypatch.setattr(grpo_utils.flags, table, dict(getattr(grpo_utils.flags, table)))

    def arguments():
        p = build()
        declare(p.add_argument("--fork-scale", type=float, default=1.0), ["resume"], bounds=(0, 10, "a fork's range"))
        return p

    monkeypatch.setattr(train_grpo, "arguments", arguments)
    with pytest.raises(ValueError, match=re.escape("--fork-scale must be in [0, 10] (got 11): a fork's range")):
        check_args(train_grpo.parse_args(["--fork-scale", "11"]), world=1)
    check_args(train_grpo.parse_args(["--fork-scale", "10"]), world=1)


def test_every_float_flag_is_bounded_where_float32_ends():
    # 1e39 is finite in float64 and inf in float32 (clamp bounds, SAPO's gate, the loss, vLLM's sampler)
    for flag in float_flags():
        for value in ("1e39", "-1e39"):
            argv = [f"{flag}={value}", *(["--policy-loss", "sapo"] if "sapo" in flag else []),
                    *(["--overlong-buffer", "12"] if flag == "--overlong-penalty" else [])]
            with pytest.raises(ValueError, match=re.escape(f"{flag} must be ")):
                check_args(train_grpo.parse_args(argv), world=1)


def test_a_flag_that_needs_another_is_taken_with_it():
    for argv in (["--overlong-buffer", "12"], ["--overlong-buffer", "12", "--overlong-penalty", "2"],
                 ["--overlong-buffer=12", "--overlong-pen=1.0"]):  # an abbreviation is a flag given too
        args = train_grpo.parse_args(argv)
        check_args(args, world=1)
    assert "overlong_penalty" in args.flags_given and "flags_given" in not_identity()
    with pytest.raises(ValueError, match="--overlong-penalty has no effect without --overlong-buffer"):
        check_args(train_grpo.parse_args(["--overlong-penalty=1.0"]), world=1)  # the default, typed


def test_a_model_folder_without_its_config_or_tokenizer_is_named(tmp_path):
    from data.demo import model_dir

    demo_dir = Path(model_dir("demo"))

    def check(model):
        check_args(train_grpo.parse_args(["--model", str(model)]), world=1)

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"--model {tmp_path / 'empty'}: no config.json in it")):
        check(tmp_path / "empty")
    model = tmp_path / "model"
    shutil.copytree(demo_dir, model)
    check(model)
    (model / "config.json").write_text("")
    with pytest.raises(ValueError, match=re.escape(f"--model {model}: its config.json is empty")):
        check(model)
    (model / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="its config.json is not a JSON object of settings"):
        check(model)
    shutil.copy(demo_dir / "config.json", model / "config.json")
    (model / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer files in it \\(tokenizer.json, tokenizer.model, ...\\)"):
        check(model)


def test_dynamic_sampling_shows_its_rounds(monkeypatch):
    # a step of many rounds in which no group is kept showed a frozen 0/1 bar: it looked hung
    args = train_grpo.parse_args(["--model", "demo", "--dynamic-sampling", "--max-sample-rounds", "4",
                                  "--prompts-per-step", "2", "--group-size", "2"])
    monkeypatch.setattr(train_grpo, "rollout", lambda llm, rows, a, step, first: [
        {"length": 1, "row": r} for r in rows for _ in range(a.group_size)])
    monkeypatch.setattr(train_grpo, "score", lambda rollouts, a, stats: [r.update(score=0.0) for r in rollouts])
    monkeypatch.setattr(train_grpo, "all_gather_objects", lambda obj: [obj])
    monkeypatch.setattr(train_grpo, "all_reduce", lambda values, op="sum": torch.tensor(values))
    shown = []
    rollouts, _, sampling = train_grpo.rollout_step(None, [{"id": i} for i in range(8)], [], args, 1, 0, 1, {}, {},
                                                    shown.append)
    assert sampling["sample/rounds"] == 4 and len(rollouts) == 4
    assert shown == [f"sampling round {k}/4, 0/2 groups kept" for k in (2, 3, 4)]


def test_zero_stages_other_than_3_are_refused_at_the_argument_check(tmp_path):
    for stage in (0, 1, 2):
        cfg = json.loads((ROOT / "ds_config.json").read_text())
        cfg["zero_optimization"]["stage"] = stage
        (tmp_path / "ds.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=f"ZeRO stage {stage}; this trainer runs ZeRO-3 only"):
            train_grpo.deepspeed_config(train_grpo.parse_args(["--ds-config", str(tmp_path / "ds.json")]), 1)


# through the command line: the message is one line, and nothing is written
TRAINER = [
    (["--ds-config", "{d}/list.json"], "must hold a JSON object"),
    (["--output-dir", "{d}/a_file"], "is a file, not a directory"),
    (["--output-dir", "{d}/a_file/run"], "is not writable"),
    (["--dataset", "{d}/empty.jsonl"], "is empty"),
    (["--top-p", "2"], "--top-p must be in (0, 1] (got 2.0)"),
    (["--model", "{d}/cut", "--dataset", "demo", "--template", "plain", "--max-prompt-len", "32",
      "--max-response-len", "12"], "cannot load the model"),
    (["--model", "{d}/no_model"], "no_model: no config.json in it"),  # once a cut transformers error
]


@pytest.mark.parametrize("flags,message", TRAINER, ids=[" ".join(f) for f, _ in TRAINER])
def test_trainer_bad_input(flags, message, files, tmp_path):
    flags = [f.format(d=files) for f in flags]
    out = [] if "--output-dir" in flags else ["--output-dir", str(tmp_path / "run")]
    one_line_error(run("train_grpo.py", *flags, *out), message)
    assert not (tmp_path / "run" / "args.json").exists()


def test_trainer_unknown_accelerator(tmp_path):
    res = run("train_grpo.py", "--output-dir", str(tmp_path / "run"), env={**cpu_env(), "DS_ACCELERATOR": "bogus"})
    one_line_error(res, "DS_ACCELERATOR=bogus is not an accelerator DeepSpeed knows")


EVALUATE = [
    (["--model", ""], "--model is empty"),
    (["--model", "demo", "--benchmarks", ","], "--benchmarks names none"),
    (["--model", "demo", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--model", "demo", "--chunk", "0"], "--chunk must be at least 1"),
    (["--model", "demo", "--limit", "0"], "--limit must be at least 1 (got 0); omit it to evaluate every problem"),
    (["--model", "demo", "--top-p", "0"], "--top-p in (0, 1]"),
    (["--model", "demo", "--temperature", "nan"], "--temperature must be a finite number (got nan)"),
    (["--model", "demo", "--seed", "-1"], "--seed must be in [0, 2147483647]"),
    (["--model", "demo", "--temperature", "0", "--n", "2"], "--temperature 0 is greedy: its --n 2 samples would all "
     "be one; give --n 1"),  # once a vLLM traceback
    (["--model", "demo", "--temperature", "1e300"], "--temperature must be 0 (greedy) or in [0.01, 100]"),
    (["--model", "demo", "--temperature", "1e-3"], "--temperature must be 0 (greedy) or in [0.01, 100]"),
]


@pytest.mark.parametrize("flags,message", EVALUATE, ids=[" ".join(f) for f, _ in EVALUATE])
def test_evaluate_flag_ranges(flags, message, capsys):
    import evaluate

    with pytest.raises(SystemExit):
        evaluate.parse_args(flags)
    assert message in capsys.readouterr().err


def test_evaluate_bad_files(files):
    one_line_error(run("evaluate.py", "--model", str(files / "cut"), "--benchmarks", "demo-test"), "damaged weights")
    one_line_error(run("evaluate.py", "--model", "demo", "--benchmarks", "math500", "--data-dir",
                       str(files / "nowhere")), "--data-dir")


def read_only(d, *cmd: str) -> subprocess.CompletedProcess:
    """cmd (a script of this project and its flags) with d mounted read-only: a bind mount in a user and mount
    namespace of its own, since as root a chmod stops no write."""
    mount = 'mount --bind "$0" "$0" && mount -o bind,remount,ro "$0" "$0" && exec "$@"'
    if subprocess.run(["unshare", "-rm", "sh", "-c", mount, str(d), "true"], capture_output=True).returncode:
        pytest.skip("no user and mount namespace here (unshare -rm) to mount a directory read-only in")
    return subprocess.run(["unshare", "-rm", "sh", "-c", mount, str(d), sys.executable, *cmd], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=cpu_env())


def test_evaluate_names_a_read_only_run_before_the_engine(tmp_path):
    from data.demo import model_dir

    rd = tmp_path / "run"
    shutil.copytree(model_dir("demo"), rd / "checkpoints" / "step_000001")
    (rd / "args.json").write_text(json.dumps({"agg": "balanced"}))  # no initial policy: the checkpoint alone
    flags = ["--benchmarks", "demo-test", "--template", "plain", "--n", "1", "--max-tokens", "48"]  # 512-token context
    res = read_only(rd, "evaluate.py", "--run", str(rd), *flags)
    one_line_error(res, f"{rd}/checkpoints/step_000001/eval/")  # once OSError: [Errno 30] after the engine started
    assert "Read-only file system" in res.stderr and "the samples are cached there; make it writable" in res.stderr
    # the table's --out, where the samples can be written
    import evaluate

    with pytest.raises(SystemExit) as e:
        evaluate.main(["--run", str(rd), *flags, "--out", str(rd / "args.json")])
    said = str(e.value.code)
    assert said.startswith(f"evaluate.py: error: {rd / 'args.json'} is not writable ([Errno 17] File exists")
    assert said.endswith("the table goes there; give another --out")


def test_evaluate_refuses_a_checkpoint_without_its_tokenizer(tmp_path):
    import evaluate
    from data.demo import model_dir

    ckpt = tmp_path / "ckpt"
    shutil.copytree(model_dir("demo"), ckpt)
    (ckpt / "tokenizer.json").unlink()  # once: vLLM's "The decoder prompt cannot be empty", an empty samples file
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", str(ckpt), "--benchmarks", "demo-test", "--n", "1"])
    assert str(e.value.code) == f"evaluate.py: error: {ckpt}: no tokenizer files in it (tokenizer.json, " \
        "tokenizer.model, ...): copy them from the model it was trained from"
    assert not (ckpt / "eval").exists()
    with pytest.raises(RuntimeError), evaluate.appending(tmp_path / "s.jsonl"):  # an engine failing on chunk 1
        raise RuntimeError
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.slow  # eight tool processes, each importing torch and the trainer: about 20 s
def test_ablation_checks_every_argument_before_the_first_run(tmp_path):
    out = ["--out", str(tmp_path / "abl")]
    one_line_error(run("scripts.ablation", "--nproc", "0", *out), "--nproc must be at least 1")
    one_line_error(run("scripts.ablation", *out, "--", "--lr", "-1"), "--lr must be in (0, 1]")
    one_line_error(run("scripts.ablation", "--eval-args", "--n 0", *out), "--n must be at least 1")
    one_line_error(run("scripts.ablation", *out, "--", "--no-std-norm"), "the ablation's dr-grpo already sets it")
    one_line_error(run("scripts.compare_rules", str(tmp_path / "abl")), "no such directory")
    one_line_error(run("scripts.compare_rules", "--factorial", str(tmp_path / "abl")), "no such directory")
    for task in ("lab", "nope"):
        one_line_error(run("scripts.compare_rules", "--predict", task),
                       "knows the right responses of the lab-check tasks")
    assert not (tmp_path / "abl").exists()


def test_prepare_refuses_empty_and_mismatched_files(files, tmp_path):
    one_line_error(run("data.prepare", "math500", "--from", str(files / "empty.jsonl"), "--out", str(tmp_path)),
                   "is empty")
    res = run("data.prepare", "math500", "--from", str(BENCHMARKS / "humaneval.jsonl"), "--out", str(tmp_path))
    one_line_error(res, "164 of 164 rows are not math problems, but math500 is a math dataset")
    assert not list(tmp_path.glob("*.jsonl"))  # nothing written where the trainer reads first


def test_shipped_benchmarks_load_by_name_offline(monkeypatch):
    from data import prepare

    shipped = [n for n, e in prepare.DATASETS.items() if (prepare.SHIPPED_DIR / e["file"]).exists()]
    assert {"math500", "aime24", "amc23", "gsm8k", "humaneval", "mbpp", "livecodebench"} <= set(shipped)
    for name in shipped:
        if not prepare.DATASETS[name].get("train"):
            rows = prepare.load_rows(name)
            assert rows and {r["kind"] for r in rows} == {prepare.DATASETS[name]["kind"]}, name

    def hub(*spec):
        raise ValueError(f"hub {spec[0]}")

    monkeypatch.setattr(prepare, "_read_hub", hub)
    with pytest.raises(ValueError, match="hub BytedTsinghua-SIA/DAPO-Math-17k"):  # never its 106-row sample
        prepare.load_rows("dapo17k")


@pytest.mark.slow  # a trainer process: imports and a DeepSpeed start, 5-10 s
def test_a_launch_that_trained_nothing_binds_no_arguments(tmp_path):
    # args.json is written with the first checkpoint: a launch that failed before it (here after the
    # rendezvous) leaves nothing that refuses the corrected command, with other arguments
    out = ["--output-dir", str(tmp_path / "run")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    one_line_error(run("train_grpo.py", "--dataset", str(bad), *out), "has no 'answer'")
    one_line_error(run("train_grpo.py", "--dataset", str(bad), "--agg", "token", *out), "has no 'answer'")


@pytest.mark.slow  # a trainer process: imports and a DeepSpeed start, 5-10 s
def test_a_second_plain_launch_takes_a_free_port(tmp_path):
    # `python train_grpo.py` used to take port 29531 always: the second of two runs died with EADDRINUSE
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 29531))
        busy.listen()
        env = {k: v for k, v in cpu_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        res = run("train_grpo.py", "--dataset", str(bad), "--output-dir", str(tmp_path / "run"), env=env)
    one_line_error(res, "has no 'answer'")  # it got past the rendezvous


def checkpointed_run(root, steps: int = 3, world: int = 1):
    """A run directory with complete checkpoints step_1..step_N, as the trainer writes them
    (no engine: the files a resume checks, with real torch and safetensors contents)."""
    import torch

    args = train_grpo.parse_args(["--output-dir", str(root), "--steps", str(steps)])
    (root / "args.json").parent.mkdir(parents=True, exist_ok=True)
    (root / "args.json").write_text(json.dumps(vars(args)))
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))
    identity = run_identity(vars(args))
    for s in range(1, steps + 1):
        ck = root / "checkpoints" / f"step_{s:06d}" / "state"
        ck.mkdir(parents=True)
        (ck.parent / "trainer_state.json").write_text(json.dumps({"step": s, "order": [], "bad_streak": 0,
                                                                   "run": identity}))
        for r in range(world):
            torch.save({"r": r}, ck / f"rng_rank{r}.pt")
            torch.save({"o": r}, ck / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
            torch.save({"m": r}, ck / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    (root / "checkpoints" / "latest").write_text(f"step_{steps:06d}")
    return args


def test_a_flag_a_fork_adds_without_declaring_it_is_part_of_the_runs_identity(tmp_path, monkeypatch):
    """A flag added as a fork adds it, a(...) with no run=, is part of the run's identity: a resume that changes it
    is refused in one line. Declared run="resume", the same resume continues the run."""
    build = train_grpo.arguments

    def forked(run: str = "") -> None:
        def arguments():
            p = build()
            declare(p.add_argument("--fork-knob", type=float, default=0.5), run.split())  # a(...)'s call
            return p

        monkeypatch.setattr(grpo_utils.flags, "_DECLARED", {})
        monkeypatch.setattr(train_grpo, "arguments", arguments)

    forked()
    checkpointed_run(tmp_path / "run")  # trained with --fork-knob 0.5
    argv = ["--output-dir", str(tmp_path / "run"), "--steps", "3", "--resume", "--fork-knob", "0.7"]
    with pytest.raises(ValueError, match=re.escape("holds a run with other arguments (--fork-knob 0.5 -> 0.7), "
                                                   "which no resume changes: use another --output-dir")):
        check_output_dir(train_grpo.parse_args(argv), tmp_path / "run", 1)
    forked("resume")
    assert check_output_dir(train_grpo.parse_args(argv), tmp_path / "run", 1)[0].name == "step_000003"


def test_every_flag_says_what_it_is_to_a_run():
    # every flag is declared through a(...) (a flag added around it would still be the run's identity), and the
    # roles agree: a device default may change on --resume (a run moves between devices), and a micro-batch
    # size is never the run's identity (the gradient is the same for any: tests/test_invariance.py)
    parser = train_grpo.arguments()
    dests = {action.dest for action in parser._actions} - {"help"}
    assert dests == set(flag_roles())
    assert flags_with("device") <= flags_with("resume")
    assert flags_with("size") <= flags_with("resume") | flags_with("launch")
    assert before_flag() == {"code_reward": "fraction"}
    with pytest.raises(ValueError, match="--x: run=.'resum'. is not one of resume, launch, device, size"):
        declare(argparse.ArgumentParser().add_argument("--x"), ["resum"])


def test_resume_takes_the_newest_complete_checkpoint(tmp_path):
    args = checkpointed_run(tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "latest").write_text("")  # an emptied pointer is not a fresh start
    assert check_output_dir(args, tmp_path / "run", 1) == [ckpts / f"step_{s:06d}" for s in (3, 2, 1)]
    (ckpts / "step_000003" / "trainer_state.json").unlink()
    shard = ckpts / "step_000002" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    assert check_output_dir(args, tmp_path / "run", 1) == [ckpts / "step_000001"]
    with pytest.raises(ValueError, match="written by 1 ranks, this launch has 2: launch it with 1"):
        check_output_dir(args, tmp_path / "run", 2)


def test_a_run_with_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    checkpointed_run(tmp_path / "run", steps=2)
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_000002" / "state" / "rng_rank0.pt").write_bytes(b"")
    (ckpts / "step_000001" / "trainer_state.json").write_text("{")
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    res = run("train_grpo.py", "--output-dir", str(tmp_path / "run"), "--steps", "2")
    one_line_error(res, "holds checkpoints but none can be resumed: step_000002 (state/rng_rank0.pt is damaged")
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics  # nothing cut, nothing purged


@pytest.mark.slow  # a trainer process: imports and a DeepSpeed start, 5-10 s
def test_finished_run_relaunched_with_resume_and_other_arguments_keeps_its_record(tmp_path):
    checkpointed_run(tmp_path / "run", steps=2)
    before = (tmp_path / "run" / "args.json").read_bytes()
    # a trailing slash is the same run; --resume with another lr trains nothing, so nothing is rewritten
    res = run("train_grpo.py", "--output-dir", f"{tmp_path / 'run'}/", "--steps", "2")
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr[-2000:]
    res = run("train_grpo.py", "--output-dir", str(tmp_path / "run"), "--steps", "2", "--resume", "--lr", "1e-3")
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr[-2000:]
    assert (tmp_path / "run" / "args.json").read_bytes() == before
    moved = tmp_path / "moved"
    os.rename(tmp_path / "run", moved)  # a moved run directory is the same run
    res = run("train_grpo.py", "--output-dir", str(moved), "--steps", "2")
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr[-2000:]


@pytest.mark.slow  # a trainer process: imports and a DeepSpeed start, 5-10 s
def test_a_finished_run_older_than_code_reward_says_which_reward_it_keeps(tmp_path):
    checkpointed_run(tmp_path / "run", steps=2)
    for ck in (tmp_path / "run" / "checkpoints").glob("step_*"):
        state = json.loads((ck / "trainer_state.json").read_text())
        (ck / "trainer_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "run"}))
    record = json.loads((tmp_path / "run" / "args.json").read_text())
    (tmp_path / "run" / "args.json").write_text(json.dumps({k: v for k, v in record.items() if k != "code_reward"}))
    res = run("train_grpo.py", "--output-dir", str(tmp_path / "run"), "--steps", "2")
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr[-2000:]
    assert f"{tmp_path / 'run'} predates --code-reward: it goes on with --code-reward fraction" in res.stdout


# ----------------------------------------------------------------------------------------------------
# A run owns its directory: one writer, checkpoints that know their run, a log without repeated steps


def test_a_held_output_dir_refuses_a_second_launch_and_the_lock_dies_with_its_holder(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib; from grpo_utils import run_dir; "
         "run_dir.lock_output_dir(pathlib.Path(sys.argv[1])); print('locked', flush=True); sys.stdin.read()", str(out)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=cpu_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = train_grpo.parse_args(["--output-dir", str(out)])
        with pytest.raises(ValueError, match=re.escape(f"is in use by another launch (pid {holder.pid} on "
                                                       f"{socket.gethostname()}, since ")):
            check_output_dir(args, out, 1)
        monkeypatch.setenv("RANK", "1")  # the run's other ranks (and nodes) share the directory: one lock per run
        assert check_output_dir(args, out, 2) == []
        monkeypatch.setenv("RANK", "0")
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, and the kernel drops the lock with the process
        holder.wait()
    assert check_output_dir(args, out, 1) == []
    assert (out / "run.lock").read_text().startswith(f"pid {os.getpid()} on ")


def test_checkpoints_carry_the_run_identity(tmp_path):
    def check(run, *flags):
        return check_output_dir(train_grpo.parse_args(["--output-dir", str(run), *flags]), run, 1)

    run = tmp_path / "run"
    checkpointed_run(run, steps=2)
    (run / "args.json").unlink()  # the checkpoint itself says which run it belongs to
    for resume in ([], ["--resume"]):
        with pytest.raises(ValueError, match=re.escape(f"{run}/checkpoints/step_000002 holds a run with other "
                                                       "arguments (--agg balanced -> token), which no resume changes")):
            check(run, "--agg", "token", *resume)
    with pytest.raises(ValueError, match=re.escape("(--lr 0.0002 -> 0.001); use another --output-dir, or --resume")):
        check(run, "--lr", "1e-3")
    assert len(check(run, "--lr", "1e-3", "--resume")) == 2  # --resume may change the optimisation knobs

    # a token run whose checkpoints/ were replaced by a balanced run's
    other = tmp_path / "token"
    checkpointed_run(other, steps=1)
    (other / "args.json").write_text(json.dumps(vars(train_grpo.parse_args(["--agg", "token",
                                                                           "--output-dir", str(other)]))))
    shutil.rmtree(other / "checkpoints")
    shutil.copytree(run / "checkpoints", other / "checkpoints")
    with pytest.raises(ValueError, match=re.escape("step_000002 holds a run with other arguments (--agg balanced -> "
                                                   "token)")):
        check(other, "--agg", "token")

    # the DeepSpeed config by its contents: another clone's path to the same file is the same run
    same = tmp_path / "same.json"
    same.write_text((ROOT / "ds_config.json").read_text())
    assert len(check(run, "--ds-config", str(same))) == 2
    changed = json.loads(same.read_text())
    changed["optimizer"]["params"]["eps"] = 1e-6
    same.write_text(json.dumps(changed))
    with pytest.raises(ValueError, match=re.escape("(--ds-config (its contents) -> (its contents))")):
        check(run, "--ds-config", str(same))

    # a flag added to the trainer after the run was written counts as its default
    state = run / "checkpoints" / "step_000002" / "trainer_state.json"
    record = json.loads(state.read_text())
    del record["run"]["mask_truncated"]
    state.write_text(json.dumps(record))
    assert len(check(run)) == 2
    with pytest.raises(ValueError, match=re.escape("(--mask-truncated False -> True)")):
        check(run, "--mask-truncated")


def test_a_run_older_than_code_reward_goes_on_with_the_fraction_it_was_trained_with(tmp_path, capsys):
    def check(run, *flags):
        args = train_grpo.parse_args(["--output-dir", str(run), *flags])
        defaults = vars(train_grpo.parse_args(["--model", args.model]))
        checkpoints, as_trained = run_dir.check_output_dir(args, run, 1, defaults)
        return argparse.Namespace(**{**vars(args), **as_trained}), checkpoints  # as checked_launch goes on

    run = tmp_path / "run"
    checkpointed_run(run, steps=2)
    for ck in (run / "checkpoints").glob("step_*"):  # no identity record: args.json is the run's record
        state = json.loads((ck / "trainer_state.json").read_text())
        del state["run"]
        (ck / "trainer_state.json").write_text(json.dumps(state))
    record = json.loads((run / "args.json").read_text())
    del record["code_reward"]  # written before the flag: the pass fraction scored code
    (run / "args.json").write_text(json.dumps(record))
    args, ckpts = check(run)
    assert len(ckpts) == 2 and args.code_reward == "fraction"  # what args.json and the checkpoints then record
    assert f"[grpo] {run} predates --code-reward: it goes on with --code-reward fraction, as it was trained" \
        in capsys.readouterr().out
    args, ckpts = check(run, "--code-reward", "fraction")  # as the README advised such runs: accepted
    assert len(ckpts) == 2 and args.code_reward == "fraction" and "predates" not in capsys.readouterr().out
    with pytest.raises(ValueError, match=re.escape("(--code-reward fraction -> all-pass), which no resume changes")):
        check(run, "--code-reward", "all-pass", "--resume")

    # an identity record without the key: the same
    state = run / "checkpoints" / "step_000002" / "trainer_state.json"
    identity = run_identity(vars(train_grpo.parse_args(["--output-dir", str(run), "--steps", "2"])))
    del identity["code_reward"]
    state.write_text(json.dumps({**json.loads(state.read_text()), "run": identity}))
    assert check(run)[0].code_reward == "fraction"
    # a run that records its reward keeps it
    new = tmp_path / "new"
    checkpointed_run(new, steps=1)
    assert check(new)[0].code_reward == "all-pass"
    with pytest.raises(ValueError, match=re.escape("(--code-reward all-pass -> fraction), which no resume")):
        check(new, "--code-reward", "fraction")


def test_a_run_lock_that_is_a_directory_and_a_dangling_link_are_named(tmp_path):
    run = tmp_path / "run"
    (run / "run.lock").mkdir(parents=True)  # once IsADirectoryError, 20 lines
    args = train_grpo.parse_args(["--output-dir", str(run)])
    with pytest.raises(ValueError, match=re.escape(f"{run}/run.lock is a directory, where the run's lock file goes")):
        check_output_dir(args, run, 1)
    # once "not writable ([Errno 17] File exists)", naming neither the link nor its target
    os.symlink(tmp_path / "gone", tmp_path / "link")
    for out in (tmp_path / "link", tmp_path / "link" / "run"):
        with pytest.raises(ValueError, match=re.escape(f"--output-dir {out}: {tmp_path / 'link'} is a symbolic link "
                                                       f"to {tmp_path / 'gone'}, which does not exist")):
            check_output_dir(train_grpo.parse_args(["--output-dir", str(out)]), out, 1)
    # the run's other files as directories: once IsADirectoryError tracebacks
    for name, message in (("metrics.jsonl", "metrics.jsonl: [Errno 21] Is a directory"),
                          ("args.json", "args.json cannot be read as JSON ([Errno 21] Is a directory")):
        other = tmp_path / name.split(".")[0]
        (other / name).mkdir(parents=True)
        with pytest.raises(ValueError, match=re.escape(message)):
            check_output_dir(train_grpo.parse_args(["--output-dir", str(other)]), other, 1)


def test_resume_with_nothing_to_resume_says_so(tmp_path):
    for out in (tmp_path / "empty", tmp_path / "mistyped"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(SystemExit) as e:
            train_grpo.main(["--output-dir", str(out), "--resume"])
        assert str(e.value.code) == (f"train_grpo.py: error: --resume: {out} holds no checkpoint to resume from "
                                     "(no checkpoints/step_N); drop --resume to start a run there, or check the "
                                     "directory")


def test_only_the_trainers_own_names_are_checkpoints(tmp_path, demo_dir):
    import evaluate

    run = tmp_path / "run"
    args = checkpointed_run(run, steps=3)
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / "step_000001", ckpts / "step_best")  # a user's copy: once "resumed" over steps 2-3
    shutil.copytree(ckpts / "step_000002", ckpts / "step_000002.bak")  # a backup: once pruned by --keep-last
    (ckpts / "step_000004.tmp").mkdir()  # a save in progress
    assert check_output_dir(args, run, 1) == [ckpts / f"step_{s:06d}" for s in (3, 2, 1)]
    assert [c.name for c in checkpoint_dirs(ckpts)] == ["step_000001", "step_000002", "step_000003"]
    assert [s for s, _ in evaluate.run_checkpoints(str(run))] == [0, 1, 2, 3]
    assert "step_000003 (step 3)" in resume_point(run, 1)


def test_damaged_records_are_named_before_any_engine(tmp_path, capsys):
    run = tmp_path / "run"
    args = checkpointed_run(run, steps=3)
    state = run / "checkpoints" / "step_000003" / "trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": "one"}))
    assert check_output_dir(args, run, 1)[0].name == "step_000002"
    assert "step_000003 (trainer_state.json: step and bad_streak must be counts (got 'one', 0))" in \
        capsys.readouterr().out

    log = run / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 4, "reward/me')  # cut by a kill while it was written: dropped
    assert [s for s, _ in run_dir.logged_lines(log)] == [1, 2, 3]
    log.write_text('{"step": 1}\n{"step": "one"}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=re.escape(f"{log} line 2: no integer 'step'; expected one JSON object")):
        check_output_dir(args, run, 1)
    log.write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff"}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=re.escape(f"{log} line 2: 'utf-8' codec can't decode")):
        check_output_dir(args, run, 1)


def test_a_run_killed_mid_write_is_read_alike_by_every_tool(tmp_path):
    """metrics.jsonl cut by a kill inside its last line, with a step logged in two lines (rollout, then its
    evaluation), and args.json: the trainer, evaluate.py's plots and compare_rules read one record."""
    import evaluate
    from scripts import compare_rules

    run = tmp_path / "run"
    run.mkdir()
    lengths = {"length/cv": 0.5, "length/pos_neg_gap": 2.0, "length/mean": 9.0}
    rows = [{"step": 1, "reward/accuracy": 10.0, "loss/pg": 0.5, **lengths}, {"step": 1, "eval/acc": 3.0},
            {"step": 2, "reward/accuracy": 20.0, "loss/pg": -0.5, **lengths}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "reward/acc')
    assert run_dir.run_metrics(run) == {1: {**rows[0], **rows[1]}, 2: rows[2]}
    assert evaluate.training_curves(str(run), ["loss/pg", "eval/acc"]) == {"loss/pg": {0: 0.5, 1: -0.5},
                                                                          "eval/acc": {0: 3.0}}
    assert compare_rules.training_curve(run) == {1: {**rows[0], **rows[1]}, 2: rows[2]}
    results = {s: {"demo-test": {"acc@4": a}, "average": {"acc@4": a}} for s, a in ((0, 0.1), (2, 0.3))}
    paths = evaluate.plot_runs({str(run): results}, {"run": [str(run)]}, ["demo-test"], 4, tmp_path)
    assert [p.name for p in paths] == ["figure1_accuracy.png", "figure2_pg_loss.png", "figure3_length.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    (run / "args.json").write_text('{"agg": "tok')  # args.json cut likewise (before its atomic write)
    for read in (lambda: evaluate.run_label(str(run)), lambda: compare_rules.run_table(tmp_path)):
        with pytest.raises(ValueError, match=re.escape(f"{run / 'args.json'} cannot be read as JSON")):
            read()


def test_a_relaunch_never_logs_a_step_twice(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    out = tmp_path / "run"
    args = train_grpo.parse_args(["--output-dir", str(out)])
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(3)))
    with SummaryWriter(str(out / "tb")) as w:  # a launch that logged steps 0-2, then ended before any checkpoint
        for s in range(3):
            w.add_scalar("x", s, s)

    def launch(start: int, steps: range) -> None:
        log, close = train_grpo.open_loggers(args, out, 0, start)
        for s in steps:
            log(s, {"x": 10 * s + start})
        close()

    def logged() -> tuple[list, list]:
        acc = EventAccumulator(str(out / "tb"))
        acc.Reload()
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [(m["step"], m["x"]) for m in lines], [(e.step, e.value) for e in acc.Scalars("x")]

    launch(0, range(2))  # starts afresh: step 0's evaluation is logged again, once
    assert logged() == ([(0, 0), (1, 10)], [(0, 0.0), (1, 10.0)])
    launch(1, range(2, 4))  # resumes from a step-1 checkpoint
    assert logged() == ([(0, 0), (1, 10), (2, 21), (3, 31)], [(0, 0.0), (1, 10.0), (2, 21.0), (3, 31.0)])


# ----------------------------------------------------------------------------------------------------
# DeepSpeed's JIT cache: one folder per install, no stale build lock, writable


def test_jit_cache_is_per_install(monkeypatch):
    import importlib.util
    from types import SimpleNamespace

    here = engines.jit_extensions_dir()
    # set at import, unless the user set it (conftest.ENVIRON: the environment before the trainer's import)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == ENVIRON.get("TORCH_EXTENSIONS_DIR", here)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(
        origin="/elsewhere/.venv/deepspeed/__init__.py") if name == "deepspeed" else real(name))
    other = engines.jit_extensions_dir()
    assert other != here and os.path.dirname(other) == os.path.dirname(here)


def test_a_stale_jit_build_lock_is_cleared_and_a_live_one_kept(tmp_path, monkeypatch, capsys):
    import threading

    cfg = train_grpo.deepspeed_config(train_grpo.parse_args([]), 1)
    assert engines.jit_ops(cfg) == []  # the CPU's collectives build no op (start_deepspeed_comm), nor torch's AdamW
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert engines.jit_ops(cfg) == ["cpu_adam"]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")  # left by a launch killed while it built: torch would wait for it forever
    assert engines.on_local_filesystem(lock)
    engines.check_jit_cache(cfg, 0)
    out = capsys.readouterr().out
    assert not lock.exists() and f"[grpo] removed {lock}: a JIT build lock whose builder is gone" in out
    assert "[grpo] building DeepSpeed's cpu_adam op into" in out  # what the next minutes are

    lock.write_text("")
    builder = subprocess.Popen([sys.executable, "-c", "import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                                "print('open', flush=True); sys.stdin.read()", str(lock)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "open"
        assert engines.lock_holders(lock) == [builder.pid]
        engines.check_jit_cache(cfg, 0)  # a build running on this machine: left to torch, which waits for it
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()

    # a cache shared with other machines: waited for, then named with the command that clears it
    monkeypatch.setattr(engines, "on_local_filesystem", lambda path: False)
    with pytest.raises(ValueError, match=re.escape(f"held by no process on this machine for 0 s, left by a launch "
                                                   f"killed while it built; if no other node builds into this "
                                                   f"cache, rm {lock}")):
        engines.clear_stale_build_lock(lock, speak=True, wait_s=0.3)
    threading.Timer(0.5, lock.unlink).start()  # another node's build ends
    engines.clear_stale_build_lock(lock, speak=True, wait_s=30)
    assert "another node building into a shared cache?" in capsys.readouterr().out


def test_an_unwritable_jit_cache_is_one_line(tmp_path, monkeypatch, files):
    cfg = train_grpo.deepspeed_config(train_grpo.parse_args([]), 1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}  # CPU Adam: an op to build
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(files / "a_file" / "ext"))
    with pytest.raises(ValueError, match=re.escape(f"the JIT extension cache {files}/a_file/ext is not writable")):
        engines.check_jit_cache(cfg, 0)
    # on CUDA nothing is JIT-built by default (torch's fused AdamW); optimizer offload builds CPU Adam
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engines.jit_ops(train_grpo.deepspeed_config(train_grpo.parse_args([]), 1)) == []
    assert engines.jit_ops(cfg) == ["cpu_adam"]


# ----------------------------------------------------------------------------------------------------
# Datasets and the other scripts


DATASET_LINES = [
    (b'{"prompt": "1+1?", "answer": "2"}\n{"prompt": "caf\xe9?", "answer": "3"}\n', "rows.jsonl",
     "line 2: byte 0xe9 at column 16 is not UTF-8; expected UTF-8 text"),
    (b'{"prompt": "1+1?", "answer": "2"}\n{"prompt": "x", "answer": \n', "rows.jsonl",
     "line 2: not JSON (Expecting value, column 27); expected one JSON object per line, e.g. {\"prompt\""),
    (b'{"prompt": "1+1?", "answer": "2"}\n[1, 2]\n', "rows.jsonl", "line 2: a JSON list, not an object"),
    (b"prompt,answer\n1+1?,2\n", "rows.csv", "not a file format read here; expected .jsonl (one JSON object per line"),
]


@pytest.mark.parametrize("data,name,message", DATASET_LINES, ids=[m.split(";")[0] for _, _, m in DATASET_LINES])
def test_a_bad_dataset_file_names_its_line_and_what_is_expected(data, name, message, tmp_path):
    from data.prepare import load_rows

    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(f"dataset {tmp_path / name}: {message}" if "format" in message
                                                   else f"dataset {tmp_path / name} {message}")):
        load_rows(str(tmp_path / name))


def test_length_drift_never_prints_an_empty_result(tmp_path, monkeypatch):
    from scripts import length_drift

    run = tmp_path / "abl" / "lab-balanced-s1"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"agg": "balanced"}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "length/mean": 9.0}) + "\n" for s in range(41)))
    for target, message in ((tmp_path / "nowhere", "nowhere: no such directory"),
                            (tmp_path, "no training runs in it"),
                            (tmp_path / "abl", "step_000010: no cached samples (run evaluate.py on it")):
        monkeypatch.setattr(sys, "argv", ["length_drift.py", str(target)])
        with pytest.raises(SystemExit) as e:
            length_drift.main()
        assert str(e.value.code).startswith("length_drift.py: error: ") and message in str(e.value.code)


BENCH = [(["--repeats", "0"], "--repeats must be at least 1"),
         (["--group-size", "0"], "--group-size must be at least 2"),  # once after 150 s of probes and engines
         (["--sync-hidden", "100"], "multiples of 64"), (["--model", "nowhere"], "--model nowhere: no such directory"),
         (["--out", "/nonexistent/b.json"], "must be a file in an existing directory"),
         # a folder no file can be made in, which os.access passed as root: the benchmark ran, then lost its numbers
         (["--out", "/proc/b.json"], "--out /proc/b.json: its directory is not writable ("),
         (["--update-only", "--peak-tflops", "-1"], "--peak-tflops must be in (0, 1e6]"),  # once MFU -0.004
         (["--peak-tflops", "1e300"], "--peak-tflops must be in (0, 1e6]"),
         (["--peak-tflops", "nan"], "--peak-tflops must be a finite number"),
         (["--update-only", "--update-responses", "0"], "--update-responses must be a positive multiple of 8"),
         (["--update-only", "--update-responses", "4"], "--update-responses must be a positive multiple of 8"),
         (["--update-only", "--update-responses", "12"], "the benchmark's group size (got 12)"),  # a shape error
         (["--update-only", "--response-len", "0"], "--response-len must be at least 1 (got 0)"),
         (["--update-only", "--prompt-len", "0"], "--prompt-len must be at least 1 (got 0)"),
         (["--model", str(ROOT / "data")], "data: no config.json in it"),  # once past the checks into the engines
         (["--dataset", str(ROOT / "data")], "data is a directory; give a prepared .jsonl file or a name")]


@pytest.mark.parametrize("flags,message", BENCH, ids=[" ".join(f) for f, _ in BENCH])
def test_bench_step_checks_its_arguments_before_any_engine(flags, message, monkeypatch, capsys):
    from scripts import bench_step

    monkeypatch.setattr(sys, "argv", ["bench_step.py", *flags])
    with pytest.raises(SystemExit):
        bench_step.parse_args()
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and err.splitlines()[-1].startswith("bench_step.py: error: ")


def test_bench_step_refuses_a_read_only_out(tmp_path):
    res = read_only(tmp_path, "-m", "scripts.bench_step", "--update-only", "--out", str(tmp_path / "b.json"))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    said = res.stderr.splitlines()[-1]
    assert said.startswith(f"bench_step.py: error: --out {tmp_path / 'b.json'}: its directory is not writable ([Errno "
                           "30] Read-only file system"), res.stderr[-2000:]


def short_ablation(root, steps: int = 3):
    """An ablation directory of one run that logged `steps` training steps (no checkpoint needed)."""
    run = root / "lab-balanced-s1"
    run.mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"agg": "balanced", "policy_loss": "ppo"}))
    metrics = {"loss/pg": 0.0, "length/mean": 9.0, "reward/accuracy": 0.5}
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **metrics}) + "\n" for s in range(1, steps + 1)))
    return root


@pytest.mark.parametrize("summary", [False, True])
def test_length_drift_on_runs_shorter_than_its_tables(summary, tmp_path, monkeypatch):
    from scripts import length_drift

    abl = short_ablation(tmp_path / "ablation-lab")  # once IndexError; with --summary, KeyError: 2
    monkeypatch.setattr(sys, "argv", ["length_drift.py", *(["--summary"] if summary else []), str(abl)])
    with pytest.raises(SystemExit) as e:
        length_drift.main()
    assert str(e.value.code) == (f"length_drift.py: error: {abl}/lab-balanced-s1: metrics.jsonl has no step 4 (3 "
                                 "training steps logged); the tables read steps 1-40, the lab's --steps: finish the "
                                 "run (the same ablation.py command resumes it)")


def test_length_drift_checks_its_other_arguments(tmp_path, monkeypatch, capsys, files):
    from scripts import length_drift

    abl = short_ablation(tmp_path / "ablation-lab", steps=40)
    (abl / "lab-balanced-s1" / "args.json").write_text("{}")
    cases = [([str(abl)], f"{abl}/lab-balanced-s1/args.json: no 'agg' of train_grpo.py's"),  # once KeyError
             (["--summary", str(abl), "--figure", str(files / "a_file" / "f.png")], "the --figure goes there"),
             (["--summary", str(abl), "--figure", str(files)], "is a directory; give a .png file"),
             ([str(abl), "--figure", "f.png"], "--figure goes with --summary"),
             ([str(abl), "--predict"], "--simulate and --predict go with --model"),
             ([str(abl), "--eval-args", '"--n 8'], "--eval-args '\"--n 8': No closing quotation")]
    for argv, message in cases:
        monkeypatch.setattr(sys, "argv", ["length_drift.py", *argv])
        with pytest.raises(SystemExit) as e:
            length_drift.main()
        said = capsys.readouterr().err.strip().splitlines()[-1:] + [str(e.value.code)]
        assert any("length_drift.py: error: " in line and message in line for line in said), said


def test_ablation_refuses_a_read_only_out_before_any_run(tmp_path, monkeypatch, capsys, files):
    from scripts import ablation

    res = read_only(tmp_path, "-m", "scripts.ablation", "--out", str(tmp_path / "abl"))  # once OSError at mkdir
    one_line_error(res, f"ablation.py: error: {tmp_path / 'abl'} is not writable ([Errno 30] Read-only file system")
    for argv, message in ((["--out", str(files / "a_file" / "abl")], "a_file/abl is not writable"),
                          (["--out", str(tmp_path / "abl"), "--eval-args", '"--n 8'], "No closing quotation")):
        monkeypatch.setattr(sys, "argv", ["ablation.py", *argv])
        with pytest.raises(SystemExit) as e:
            ablation.main()
        assert message in capsys.readouterr().err + str(e.value.code)
    assert not (tmp_path / "abl").exists()


def test_prepare_names_its_own_flags(tmp_path):
    res = run("data.prepare", "math500", "--from", str(tmp_path / "nowhere.jsonl"), "--out", str(tmp_path))
    one_line_error(res, f"prepare: error: --from {tmp_path / 'nowhere.jsonl'}: no such file or directory")
    assert "--data-dir" not in res.stderr  # a flag of evaluate.py's, not of prepare's
    res = read_only(tmp_path, "-m", "data.prepare", "math500", "--out", str(tmp_path / "out"))
    one_line_error(res, f"prepare: error: --out {tmp_path / 'out'} is not writable ([Errno 30] Read-only file system")


def test_ablation_refuses_a_file_as_its_output_and_seeds_out_of_range(files, monkeypatch, capsys):
    from scripts import ablation

    for flags, message in ((["--out", str(files / "a_file")], "is a file; give a directory"),
                           (["--out", str(files / "abl"), "--seeds", "1", "-1"], "--seed must be in [0, 2147483647]")):
        monkeypatch.setattr(sys, "argv", ["ablation.py", *flags])
        with pytest.raises(SystemExit) as e:
            ablation.main()
        assert message in capsys.readouterr().err + str(e.value.code)
    assert not (files / "abl").exists()


def test_evaluate_cache_key_holds_every_flag_that_changes_a_score():
    import evaluate

    base = evaluate.parse_args(["--model", "demo"])
    cut = evaluate.parse_args(["--model", "demo", "--max-model-len", "1"])  # every prompt too long: zeros
    assert evaluate.settings_key(cut)[0] != evaluate.settings_key(base)[0]
    assert "max_model_len" not in evaluate.settings_key(base)[1]  # caches made before it counted stay valid


def test_a_run_recorded_with_the_cpus_defaults_relaunches_on_cuda(tmp_path, monkeypatch):
    run, model = tmp_path / "run", ["--model", "Qwen/Qwen2.5-Math-7B", "--output-dir", str(tmp_path / "run")]
    cpu = train_grpo.parse_args(model)  # recorded with the CPU's defaults: rows of 4, log-prob chunk 256
    assert (cpu.micro_batch_size, cpu.logprob_chunk) == (4, 256)
    run.mkdir()
    (run / "args.json").write_text(json.dumps(vars(cpu)))
    monkeypatch.setattr(train_grpo.torch.cuda, "is_available", lambda: True)
    on_cuda = train_grpo.parse_args(model)
    assert (on_cuda.micro_batch_size, on_cuda.logprob_chunk, on_cuda.micro_batch_tokens) == (None, 1024, None)
    assert check_output_dir(on_cuda, run, 1) == []  # the defaults changed with the device, not by the user
    # a size the user gives is a change, which only --resume makes
    with pytest.raises(ValueError, match=re.escape("(--logprob-chunk 256 -> 512); use another --output-dir, or "
                                                   "--resume")):
        check_output_dir(train_grpo.parse_args([*model, "--logprob-chunk", "512"]), run, 1)
    # (--resume itself needs a checkpoint: test_checkpoints_carry_the_run_identity)


# ----------------------------------------------------------------------------------------------------
# The micro-batch sizes a checkpoint records: checked as the flags are, reused only on the device they were cut for


SIZES = {"device": "cpu", "micro_batch_size": 4, "micro_batch_tokens": 0, "logprob_batch_size": 16}


def recorded_sizes(tmp_path, sizes) -> dict:
    """train_grpo.recorded_sizes of a checkpoint whose trainer_state.json holds these sizes (--model demo)."""
    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "order": [], "bad_streak": 0, "sizes": sizes}))
    return train_grpo.recorded_sizes(ckpt, train_grpo.parse_args(["--output-dir", str(tmp_path)]), 1)


@pytest.mark.parametrize("change, message", [
    ({"agg": "token"}, "\"sizes\" holds 'agg', which no run records there"),  # another rule, slipped in
    # the wrong type: each as the parser takes (or refuses) its flag string, the value as it came back
    ({"micro_batch_size": "four"}, "key micro_batch_size: argument --micro-batch-size: invalid int value: 'four'"),
    ({"micro_batch_size": "4"}, 'key micro_batch_size: "4" is a string, where --micro-batch-size takes an integer'),
    ({"logprob_batch_size": [16]}, "key logprob_batch_size: argument --logprob-batch-size: invalid int value: '[16]'"),
    ({"micro_batch_tokens": 4.0}, "key micro_batch_tokens: argument --micro-batch-tokens: invalid int value: '4.0'"),
    ({"micro_batch_size": None}, "key micro_batch_size: --micro-batch-size must be a number without a token budget"),
    ({"micro_batch_tokens": None}, "key micro_batch_tokens: --micro-batch-tokens must be a number on the CPU"),
    ({"vllm_gpu_memory": None}, "key vllm_gpu_memory: null is not a number"),
    ({"device": 1}, "key device: 1 is not a name"),
    ({"device_memory": -85_031_714_816}, "key device_memory: -85031714816 is not a count of bytes"),  # once taken
    ({"device_memory": 0}, "key device_memory: 0 is not a count of bytes"),
    # out of range, as check_args says it of the flag
    ({"micro_batch_size": -4}, "key micro_batch_size: --micro-batch-size must be at least 1 (got -4)"),
    ({"micro_batch_size": 0}, "key micro_batch_size: --micro-batch-size must be at least 1 (got 0)"),
    ({"micro_batch_size": 2.5}, "key micro_batch_size: argument --micro-batch-size: invalid int value: '2.5'"),
    ({"micro_batch_tokens": -100}, "key micro_batch_tokens: --micro-batch-tokens must be >= 0 (got -100"),
    ({"micro_batch_tokens": 99.5}, "key micro_batch_tokens: argument --micro-batch-tokens: invalid int value: '99.5'"),
    ({"logprob_batch_size": -1}, "key logprob_batch_size: --logprob-batch-size must be at least 1 (got -1)"),
    ({"logprob_batch_size": 0}, "key logprob_batch_size: --logprob-batch-size must be at least 1 (got 0)"),
    ({"logprob_batch_size": 0.5}, "key logprob_batch_size: argument --logprob-batch-size: invalid int value: '0.5'"),
    ({"vllm_gpu_memory": 1.5}, "key vllm_gpu_memory: --vllm-gpu-memory must be in (0, 1) (got 1.5)"),
])
def test_recorded_sizes_are_checked_as_the_flags_are(change, message, tmp_path):
    with pytest.raises(ValueError) as e:
        recorded_sizes(tmp_path, {**SIZES, **change})
    state = tmp_path / "checkpoints" / "step_000001" / "trainer_state.json"
    said = message if message.startswith('"sizes"') else f'"sizes" {message}'
    assert str(e.value).startswith(f"{state}: {said}") and str(e.value).endswith("; repair the file")


def test_recorded_sizes_as_the_trainer_writes_them_pass(tmp_path):
    cuda = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "device_memory": 85_031_714_816,
            "vllm_gpu_memory": 0.7, "micro_batch_size": None, "micro_batch_tokens": 60_000, "logprob_batch_size": None}
    for sizes in ({}, SIZES, cuda, {"device": "cpu", "micro_batch_size": None, "micro_batch_tokens": 37,
                                    "logprob_batch_size": None}):
        assert recorded_sizes(tmp_path, sizes) == sizes
    with pytest.raises(ValueError, match='"sizes" must be a JSON object of the micro-batch sizes'):
        recorded_sizes(tmp_path, [4, 0, 16])


H100 = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "device_memory": 85_031_714_816,
        "vllm_gpu_memory": 0.7}


def test_a_resume_reuses_the_recorded_sizes_only_on_the_device_they_were_cut_for():
    sizes = {"micro_batch_size": None, "micro_batch_tokens": 60_000, "logprob_batch_size": None}
    record = {**H100, **sizes}
    assert run_dir.resumed_sizes(record, H100, ["lr"]) == (sizes, None)
    # another model, another memory, another share for vLLM: measured anew, at most the recorded budget
    for other in ({"device_name": "NVIDIA H200"}, {"device_memory": 150_121_095_168}, {"vllm_gpu_memory": 0.5}):
        assert run_dir.resumed_sizes(record, {**H100, **other}, []) == ({}, 60_000)
    older = {"device": "cuda", **sizes}  # recorded before the model and memory were
    assert run_dir.resumed_sizes(older, H100, []) == ({}, 60_000)
    # the CPU and CUDA: nothing reused either way, and no budget to cap with (0 on the CPU: none)
    assert run_dir.resumed_sizes(record, {"device": "cpu"}, []) == ({}, None)
    assert run_dir.resumed_sizes(SIZES, H100, []) == ({}, None)
    sizes = {k: SIZES[k] for k in flags_with("size")}
    assert run_dir.resumed_sizes(SIZES, {"device": "cpu"}, []) == (sizes, None)
    # a size flag given: none reused; on CUDA the recorded budget still caps a measured one
    assert run_dir.resumed_sizes(record, H100, ["micro_batch_size"]) == ({}, 60_000)
    assert run_dir.resumed_sizes(SIZES, {"device": "cpu"}, ["logprob_batch_size"]) == ({}, None)
    assert run_dir.resumed_sizes({}, H100, []) == ({}, None)  # a checkpoint older than the record
    assert run_dir.device_record(False, 0, 0.7) == {"device": "cpu"}
    assert run_dir.device_words(record) == "NVIDIA H100 80GB HBM3 (79.2 GiB, --vllm-gpu-memory 0.7)"


@pytest.mark.slow  # trainer processes: imports and a DeepSpeed start, 5-10 s each
def test_a_checkpoint_whose_sizes_were_edited_is_refused_before_any_engine(tmp_path):
    # applied as they were, "agg" once trained the next step with another rule and rewrote args.json, and a
    # negative size was taken
    out = tmp_path / "run"
    checkpointed_run(out, steps=2)
    before = (out / "args.json").read_bytes()
    state = out / "checkpoints" / "step_000002" / "trainer_state.json"
    record = json.loads(state.read_text())
    for sizes, message in (({**SIZES, "agg": "token"}, "\"sizes\" holds 'agg', which no run records there"),
                           ({**SIZES, "micro_batch_size": -4},
                            '"sizes" key micro_batch_size: --micro-batch-size must be at least 1 (got -4)')):
        state.write_text(json.dumps({**record, "sizes": sizes}))
        res = run("train_grpo.py", "--output-dir", str(out), "--steps", "3")
        one_line_error(res, f"train_grpo.py: error: {state}: {message}")
        assert "resuming from" not in res.stdout and "training prompts" not in res.stdout
        assert (out / "args.json").read_bytes() == before


# -----------------------------------------------------------------------------
# The tools refuse what they cannot do, before they work (issue 51, item 5): each case once ran, then failed or
# printed what it could not compute; now one line, before any run, engine or prediction.


PER_RUN_FLAGS = [["--agg", "token"], ["--agg=token"], ["--ag", "token"], ["--seed", "7"], ["--model", "demo"],
                 ["--output-dir", "elsewhere"], ["--eval-dataset", "demo-test"], ["--policy-loss", "gspo"],
                 ["--no-std-norm"]]


@pytest.mark.parametrize("extra", PER_RUN_FLAGS, ids=[" ".join(f) for f in PER_RUN_FLAGS])
def test_ablation_refuses_a_trainer_flag_it_sets_per_run(extra, tmp_path, monkeypatch, capsys):
    from scripts import ablation

    # `-- --agg token` came after each run's own --agg: seq, token and balanced all trained token
    flag = train_grpo.parse_args(extra).flags_given[0]
    monkeypatch.setattr(ablation.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a[0]}"))
    monkeypatch.setattr(sys, "argv", ["ablation.py", "--out", str(tmp_path / "abl"), "--", *extra])
    with pytest.raises(SystemExit):
        ablation.main()
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith(f"ablation.py: error: --{flag.replace('_', '-')} after -- would override what the "
                           "ablation sets per run: ") and said.endswith(ablation.PER_RUN[flag]), said
    assert not (tmp_path / "abl").exists()
    # every flag a run's command sets is one of them (a flag added to train_args must be added there)
    for agg in train_grpo.AGGS:
        assert set(train_grpo.parse_args(ablation.train_args("lab", agg, "ppo", 1, tmp_path, [])).flags_given) \
            <= set(ablation.PER_RUN)


def broken_args_json(run: Path) -> Path:
    """args.json as a kill halfway through its write leaves it."""
    text = json.dumps(vars(train_grpo.parse_args(["--model", "lab", "--agg", "balanced", "--seed", "1"])), indent=1)
    run.mkdir(parents=True, exist_ok=True)
    (run / "args.json").write_text(text[: len(text) // 2])
    return run / "args.json"


def test_a_cut_args_json_is_named_by_every_reader(tmp_path, monkeypatch):
    import evaluate
    from data.demo import model_dir
    from scripts import ablation, compare_rules

    run = tmp_path / "abl" / "lab-balanced-s1"
    path = broken_args_json(run)
    shutil.copytree(model_dir("lab"), run / "checkpoints" / "step_000001", ignore=shutil.ignore_patterns("eval"))
    named = f"{path} cannot be read as JSON ("
    for read in (run_dir.read_args_json, ablation.finished, evaluate.run_args,
                 lambda r: run_dir.recorded_args(r, train_grpo.parse_args([])),
                 lambda r: compare_rules.run_table(r.parent)):
        with pytest.raises(ValueError) as e:  # evaluate.py once said only "Unterminated string starting at: ..."
            read(run)
        assert str(e.value).startswith(named) and str(e.value).endswith("repair or remove it"), str(e.value)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--run", str(run), "--benchmarks", "demo-test", "--n", "1", "--limit", "1"])
    assert str(e.value.code).startswith(f"evaluate.py: error: {named}")
    # the ablation once took it for a run to train again (ablation.finished: False): now named before any run
    monkeypatch.setattr(ablation.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a[0]}"))
    monkeypatch.setattr(sys, "argv", ["ablation.py", "--aggs", "balanced", "--seeds", "1", "--out", str(run.parent)])
    with pytest.raises(SystemExit) as e:
        ablation.main()
    assert str(e.value.code).startswith(f"ablation.py: error: {named}")
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not the trainer's args.json .a JSON object of its arguments, not a list"):
        run_dir.read_args_json(run)
    path.unlink()
    assert run_dir.read_args_json(run) is None and evaluate.run_args(str(run)) == {} and not ablation.finished(run)


def test_compare_rules_on_runs_shorter_than_it_reads(tmp_path, monkeypatch):
    from scripts import compare_rules

    for agg in ("token", "balanced"):  # finished runs of 3 steps: once KeyError: -1 (late accuracy, steps T-4..T)
        for seed in (1, 2):
            run = tmp_path / f"lab-check-{agg}-s{seed}"
            run.mkdir()
            (run / "args.json").write_text(json.dumps({"agg": agg, "seed": seed, "model": "lab", "steps": 3}))
            (run / "metrics.jsonl").write_text("".join(json.dumps(
                {"step": s, "reward/accuracy": 0.5, "length/mean": 9.0, "length/pos_neg_gap": 5.0, "loss/pg": 0.1})
                + "\n" for s in range(1, 4)))
    monkeypatch.setattr(sys, "argv", ["compare_rules.py", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        compare_rules.main()
    assert str(e.value.code) == (f"compare_rules.py: error: {tmp_path / 'lab-check-token-s1'}: 3 training steps "
                                 "(its --steps); the comparison needs at least 5 (it reads steps 1-5 and the last 5): "
                                 "train runs of --steps 5 or more (ablation.py ... -- --steps N)")


def test_evaluate_refuses_max_tokens_that_leave_no_prompt_room(tmp_path):
    from transformers import AutoTokenizer

    import evaluate
    from data.demo import model_dir

    run = tmp_path / "run"
    shutil.copytree(model_dir("lab"), run / "checkpoints" / "step_000001", ignore=shutil.ignore_patterns("eval"))
    (run / "args.json").write_text(json.dumps({"agg": "balanced"}))
    ckpt = run / "checkpoints" / "step_000001"
    common = ["--run", str(run), "--benchmarks", "demo-test", "--template", "plain", "--n", "1", "--limit", "4"]
    # --max-tokens 3072 (the default) in the lab's 512-token context: once the engine started, skipped every prompt
    # and printed a table of zeros; its 4 prompts need 13-14 tokens
    for flags, context, fix in (([], 512, "give --max-tokens 498 or less"),
                                (["--max-tokens", "30", "--max-model-len", "40"], 40, "give --max-tokens 26 or less")):
        with pytest.raises(SystemExit) as e:
            evaluate.main([*common, *flags])
        assert str(e.value.code) == (f"evaluate.py: error: --max-tokens {flags[1] if flags else 3072} leaves no room "
                                     f"for any prompt of demo-test in the {context}-token context of {ckpt} (its "
                                     f"prompts need 13-14 tokens, and every one would score 0): {fix}")
    assert not (ckpt / "eval").exists()
    args = evaluate.parse_args([*common, "--max-tokens", "27", "--max-model-len", "40"])  # 3 of 4 left out: it runs
    evaluate.check_prompt_room(str(ckpt), AutoTokenizer.from_pretrained(ckpt), evaluate.load_benchmarks(args), args)


def test_prompts_left_out_of_the_context_are_counted_under_the_table(tmp_path):
    import evaluate

    args = evaluate.parse_args(["--model", "demo", "--benchmarks", "demo-test", "--n", "2"])
    cache = tmp_path / "ckpt" / "eval" / evaluate.settings_key(args)[0]
    cache.mkdir(parents=True)
    rows = [{"id": f"p{i}"} for i in range(4)]
    recs = [{"id": "p0", "scores": [1.0, 0.0]}, {"id": "p1", "scores": [1.0, 1.0]},
            *({"id": f"p{i}", "scores": [0.0, 0.0], "skipped": "prompt too long"} for i in (2, 3))]
    (cache / "demo-test.samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    results = evaluate.checkpoint_results(str(tmp_path / "ckpt"), {"demo-test": rows}, args)
    assert results["demo-test"]["skipped"] == 2
    note = "demo-test: 2 of 4 prompts longer than the context minus --max-tokens scored 0, with no response drawn"
    assert evaluate.format_table(results, 2).splitlines()[-1] == note
    table = evaluate.runs_table({"r": {1: results}}, {"r": ["r"]}, ["demo-test"], 2)
    assert table.splitlines()[-1] == note and table.splitlines()[-2] == ""
    del results["demo-test"]["skipped"]
    assert "longer than the context" not in evaluate.format_table(results, 2)


def test_reproduce_tables_only_names_the_runs_it_lacks_before_any_table(tmp_path, monkeypatch):
    from scripts import ablation, reproduce

    monkeypatch.setattr(reproduce, "ROOT", tmp_path)  # no runs/ there
    monkeypatch.setattr(reproduce.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a[0]}"))  # no prediction
    monkeypatch.setattr(sys, "argv", ["reproduce.py", "--tables-only", "lab-check"])
    with pytest.raises(SystemExit) as e:  # once minutes of --predict, then compare_rules: no such directory
        reproduce.main()
    trains = reproduce.EXPERIMENTS["lab-check"][1][0]
    assert str(e.value.code) == (
        "reproduce.py: error: --tables-only: lab-check's tables read 30 runs or files not there "
        "(runs/compare-lab-check/lab-check-seq-s1, runs/compare-lab-check/lab-check-token-s1, "
        f"runs/compare-lab-check/lab-check-token-batch-s1, ...); train them with `python -m scripts.ablation "
        f"{' '.join(trains)}`")

    def trained(argv: list[str], steps: int) -> None:  # each run's last checkpoint its final step
        for run in ablation.planned_runs(ablation.parser().parse_args(argv[: argv.index("--")] if "--" in argv
                                                                      else argv)):
            (tmp_path / run / "checkpoints" / f"step_{steps // 2:06d}").mkdir(parents=True)
            (tmp_path / run / "args.json").write_text(json.dumps({"steps": steps}))
            assert not ablation.finished(tmp_path / run)  # its last checkpoint not yet the final step
            (tmp_path / run / "checkpoints" / f"step_{steps:06d}").mkdir()

    trained(trains, 30)
    assert reproduce.untrained("lab-check") == []
    # the lab's evaluated table and figures, and the length study's reading of the lab's runs (another experiment's)
    lab = reproduce.EXPERIMENTS["lab"][1][0]
    assert [a for a, _ in reproduce.untrained("length-study")][0] == lab
    trained(lab, 40)
    assert reproduce.untrained("lab") == [(lab, [Path("runs/ablation-lab/eval_table.md"),
                                                 *(Path(src) for src, _ in reproduce.FIGURES["lab"])])]
    assert lab not in [a for a, _ in reproduce.untrained("length-study")]


# -----------------------------------------------------------------------------
# Every tool in scripts/ checks its own flags before it starts an engine or minutes of work: a bound for each
# number, each output path tried, no rule named twice or without runs. Each case once ran, then failed with a
# traceback (a PEFT one after the engine started), blamed something else, or printed less than it was asked for.


def paired_runs(root: Path, aggs=("token", "balanced"), seeds=(1, 2), steps: int = 6) -> Path:
    """Finished runs that compare_rules.py compares: paired seeds, step 1 alike under every rule."""
    for agg in aggs:
        for seed in seeds:
            run = root / f"lab-check-{agg}-s{seed}"
            run.mkdir(parents=True)
            (run / "args.json").write_text(json.dumps({"agg": agg, "seed": seed, "model": "lab", "steps": steps}))
            (run / "metrics.jsonl").write_text("".join(json.dumps(
                {"step": s, "reward/accuracy": 0.5, "length/mean": 9.0, "length/pos_neg_gap": 5.0, "loss/pg": 0.1})
                + "\n" for s in range(1, steps + 1)))
    return root


SCRIPT_FLAGS = [
    # a rule asked for by name without runs was dropped, and one named twice printed twice (exit 0 both)
    ("compare_rules", ["{runs}", "--rules", "balanced", "dr-grpo"], "{runs}: no runs of --rules dr-grpo in it (train "
     "them with ablation.py --aggs dr-grpo --out {runs}, or leave them out of --rules)"),
    ("compare_rules", ["{runs}", "--rules", "balanced", "balanced"],
     "--rules names balanced twice; give each rule once"),
    ("compare_rules", ["--predict", "lab-check", "--steps", "0"], "--steps must be at least 1 (got 0)"),
    ("compare_rules", ["{runs}", "--steps", "4"], "--steps and --steady go with --predict"),
    ("compare_rules", ["--factorial", "{runs}", "--figure", "{files}/a_file/f.png"],
     "{files}/a_file is not writable ([Errno 17] File exists"),  # once after every checkpoint's J
    ("length_drift", ["--model", "lab", "--rules", "seq", "seq"], "--rules names seq twice; give each rule once"),
    # the ledger's file once failed to be written after the whole measurement
    ("memory_ledger", ["--out", "/proc/ledger.json"], "--out /proc/ledger.json: its directory is not writable ("),
    ("memory_ledger", ["--lora-rank", "-1"], "--lora-rank must be in [0, 128] (got -1): 0 is full fine-tuning"),
    ("memory_ledger", ["--lora-rank", "129"], "--lora-rank must be in [0, 128] (got 129): 0 is full fine-tuning, and a "
     "rank above the --shape s1's hidden size 128 adds nothing"),
    ("memory_ledger", ["--prompts", "0"], "--prompts must be a positive even number (got 0)"),  # blamed the model
    ("memory_ledger", ["--prompts", "3"], "--prompts must be a positive even number (got 3): a step's prompts split"),
    ("memory_ledger", ["--response-len", "0"], "--response-len must be at least 1 (got 0)"),
    ("bench_step", ["--update-only", "--lora-rank", "-1"], "--lora-rank must be in [0, 1536] (got -1)"),
    ("bench_rank_balance", ["--ranks", "0"], "--ranks must be at least 1 (got 0)"),
    ("bench_rank_balance", ["--group-size", "0", "--trials", "0"], "--group-size must be at least 2 (got 0)"),
    ("bench_rank_balance", ["--trials", "0"], "--trials must be at least 1 (got 0)"),
    ("bench_rank_balance", ["--groups", "-1"], "--groups must be at least 1 (got -1)"),  # once: a multiple of --ranks
    ("bench_rank_balance", ["--seed", "-1"], "--seed must be at least 0 (got -1)"),
    ("bench_sandbox", ["--against", str(ROOT), "--workers", "4", "0"], "--workers must be at least 1 (got 0)"),
    ("bench_sandbox", ["--against", str(ROOT), "--passes", "0"], "--passes must be at least 1 (got 0)"),
]


def error_lines(script: str, argv: list[str], monkeypatch, capsys) -> list[str]:
    """What scripts/SCRIPT.py says of `argv` and ends on, run in this process (a process each costs 1.6 s of
    imports): argparse's line on stderr, or sys.exit's message."""
    import importlib

    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"scripts.{script}").main()
    said = capsys.readouterr().err.splitlines() + ([e.value.code] if isinstance(e.value.code, str) else [])
    return [line for line in said if "error:" in line]


@pytest.mark.parametrize("script,flags,message", SCRIPT_FLAGS,
                         ids=[f"{s} {' '.join(f)}" for s, f, _ in SCRIPT_FLAGS])
def test_every_script_checks_its_flags_before_any_work(script, flags, message, files, tmp_path, monkeypatch, capsys):
    runs = paired_runs(tmp_path / "runs")
    fill = lambda s: s.format(runs=runs, files=files)  # noqa: E731
    lines = error_lines(script, [fill(f) for f in flags], monkeypatch, capsys)
    assert len(lines) == 1 and lines[0].startswith(f"{script}.py: error: {fill(message)}"), lines


def test_the_rules_asked_for_are_compared_as_asked(tmp_path):
    # the checks above refuse only what was asked for: the default takes the rules the directory has
    runs = paired_runs(tmp_path / "runs")
    for flags in ([], ["--rules", "token", "balanced"]):
        res = run("scripts.compare_rules", str(runs), *flags)
        assert res.returncode == 0 and [x.split(" |")[0] for x in res.stdout.splitlines() if x.startswith(
            ("| token |", "| balanced |"))][:2] == ["| token", "| balanced"], res.stderr[-2000:]


def test_bench_step_lora_rank_goes_with_update_only(monkeypatch, capsys):
    from scripts import bench_step

    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--lora-rank", "8"])  # the step benchmark ignored it
    with pytest.raises(SystemExit):
        bench_step.parse_args()
    assert capsys.readouterr().err.splitlines()[-1] == ("bench_step.py: error: --lora-rank applies to --update-only "
                                                        "(the step benchmark trains the whole model)")


def test_ablation_refuses_a_rule_loss_or_seed_named_twice(tmp_path, monkeypatch, capsys):
    from scripts import ablation

    monkeypatch.setattr(ablation.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a[0]}"))
    for flags, said in ((["--aggs", "seq", "seq"], "--aggs names seq twice"),
                        (["--losses", "ppo", "gspo", "ppo"], "--losses names ppo twice"),
                        (["--seeds", "1", "2", "1"], "--seeds names 1 twice")):
        monkeypatch.setattr(sys, "argv", ["ablation.py", *flags, "--out", str(tmp_path / "abl")])
        with pytest.raises(SystemExit):
            ablation.main()
        assert capsys.readouterr().err.splitlines()[-1] == f"ablation.py: error: {said}; give each once"
    assert not (tmp_path / "abl").exists()


def test_reproduce_refuses_an_unwritable_results_file_before_any_run(files, monkeypatch):
    from scripts import reproduce

    results = files / "a_file" / "results.md"
    monkeypatch.setattr(reproduce, "RESULTS", results)
    monkeypatch.setattr(reproduce.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a[0]}"))  # no run, no table
    monkeypatch.setattr(sys, "argv", ["reproduce.py", "lab-check"])
    with pytest.raises(SystemExit) as e:  # once written after hours of runs
        reproduce.main()
    assert str(e.value.code).startswith(f"reproduce.py: error: {results} is not writable ([Errno 17] File exists")
    assert str(e.value.code).endswith("the sections and the figures go there")
