"""Bad input of every entry point (train_grpo.py, evaluate.py, ablation.py, data.prepare) fails in one
line that states the rule, before any engine starts; run directories are never lost or rewritten by a
launch that trains nothing. No engine starts in this file (the quick tier)."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from conftest import BENCHMARKS, ROOT, cpu_env

import jit_cache
import train_grpo


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
]


def test_each_policy_loss_gets_its_papers_defaults_unless_a_flag_is_given():
    args = {loss: train_grpo.parse_args(["--policy-loss", loss]) for loss in ("ppo", "gspo", "cispo", "sapo")}
    assert (args["ppo"].clip_eps_low, args["ppo"].clip_eps_high) == (0.2, 0.28)
    assert (args["gspo"].clip_eps_low, args["gspo"].clip_eps_high) == (3e-4, 4e-4)
    assert (args["cispo"].clip_eps_low, args["cispo"].clip_eps_high) == (1.0, 4.0)
    assert (args["sapo"].sapo_tau_pos, args["sapo"].sapo_tau_neg, args["sapo"].clip_eps_low) == (1.0, 1.05, None)
    assert train_grpo.parse_args(["--policy-loss", "gspo", "--clip-eps-high", "1e-3"]).clip_eps_high == 1e-3
    for a in args.values():
        train_grpo.check_args(a, world=1)


@pytest.mark.parametrize("flags,message", RANGES, ids=[" ".join(f) for f, _ in RANGES])
def test_trainer_flag_ranges(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train_grpo.check_args(train_grpo.parse_args(flags), world=1)


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
                train_grpo.check_args(train_grpo.parse_args([f"{flag}={value}"]), world=1)


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


def test_ablation_checks_every_argument_before_the_first_run(tmp_path):
    out = ["--out", str(tmp_path / "abl")]
    one_line_error(run("ablation.py", "--nproc", "0", *out), "--nproc must be at least 1")
    one_line_error(run("ablation.py", *out, "--", "--lr", "-1"), "--lr must be in (0, 1]")
    one_line_error(run("ablation.py", "--eval-args", "--n 0", *out), "--n must be at least 1")
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
    identity = train_grpo.run_identity(vars(args))
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


def test_resume_takes_the_newest_complete_checkpoint(tmp_path):
    args = checkpointed_run(tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "latest").write_text("")  # an emptied pointer is not a fresh start
    assert train_grpo.check_output_dir(args, tmp_path / "run", 1) == [ckpts / f"step_{s:06d}" for s in (3, 2, 1)]
    (ckpts / "step_000003" / "trainer_state.json").unlink()
    shard = ckpts / "step_000002" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    assert train_grpo.check_output_dir(args, tmp_path / "run", 1) == [ckpts / "step_000001"]
    with pytest.raises(ValueError, match="written by 1 ranks, this launch has 2: launch it with 1"):
        train_grpo.check_output_dir(args, tmp_path / "run", 2)


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


# ----------------------------------------------------------------------------------------------------
# A run owns its directory: one writer, checkpoints that know their run, a log without repeated steps


def test_a_held_output_dir_refuses_a_second_launch_and_the_lock_dies_with_its_holder(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib, train_grpo; train_grpo.lock_output_dir(pathlib.Path(sys.argv[1]));"
         " print('locked', flush=True); sys.stdin.read()", str(out)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=cpu_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = train_grpo.parse_args(["--output-dir", str(out)])
        with pytest.raises(ValueError, match=re.escape(f"is in use by another launch (pid {holder.pid} on "
                                                       f"{socket.gethostname()}, since ")):
            train_grpo.check_output_dir(args, out, 1)
        monkeypatch.setenv("RANK", "1")  # the run's other ranks (and nodes) share the directory: one lock per run
        assert train_grpo.check_output_dir(args, out, 2) == []
        monkeypatch.setenv("RANK", "0")
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, and the kernel drops the lock with the process
        holder.wait()
    assert train_grpo.check_output_dir(args, out, 1) == []
    assert (out / "run.lock").read_text().startswith(f"pid {os.getpid()} on ")


def test_checkpoints_carry_the_run_identity(tmp_path):
    def check(run, *flags):
        return train_grpo.check_output_dir(train_grpo.parse_args(["--output-dir", str(run), *flags]), run, 1)

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
    assert train_grpo.check_output_dir(args, run, 1) == [ckpts / f"step_{s:06d}" for s in (3, 2, 1)]
    assert [c.name for c in train_grpo.checkpoint_dirs(ckpts)] == ["step_000001", "step_000002", "step_000003"]
    assert [s for s, _ in evaluate.run_checkpoints(str(run))] == [0, 1, 2, 3]
    assert "step_000003 (step 3)" in train_grpo.resume_point(run, 1)


def test_damaged_records_are_named_before_any_engine(tmp_path, capsys):
    run = tmp_path / "run"
    args = checkpointed_run(run, steps=3)
    state = run / "checkpoints" / "step_000003" / "trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": "one"}))
    assert train_grpo.check_output_dir(args, run, 1)[0].name == "step_000002"
    assert "step_000003 (trainer_state.json: step and bad_streak must be counts (got 'one', 0))" in \
        capsys.readouterr().out

    log = run / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 4, "reward/me')  # cut by a kill while it was written: dropped
    assert [s for s, _ in train_grpo.logged_lines(log)] == [1, 2, 3]
    log.write_text('{"step": 1}\n{"step": "one"}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=re.escape(f"{log} line 2: no integer 'step'; expected one JSON object")):
        train_grpo.check_output_dir(args, run, 1)
    log.write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff"}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=re.escape(f"{log} line 2: 'utf-8' codec can't decode")):
        train_grpo.check_output_dir(args, run, 1)


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

    here = jit_cache.jit_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == here  # set at import, unless the user set it
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(
        origin="/elsewhere/.venv/deepspeed/__init__.py") if name == "deepspeed" else real(name))
    other = jit_cache.jit_extensions_dir()
    assert other != here and os.path.dirname(other) == os.path.dirname(here)


def test_a_stale_jit_build_lock_is_cleared_and_a_live_one_kept(tmp_path, monkeypatch, capsys):
    import threading

    cfg = train_grpo.deepspeed_config(train_grpo.parse_args([]), 1)
    assert jit_cache.jit_ops(cfg) == ["deepspeed_shm_comm"]  # on the CPU: its collectives
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")  # left by a launch killed while it built: torch would wait for it forever
    assert jit_cache.on_local_filesystem(lock)
    jit_cache.check_jit_cache(cfg, 0)
    out = capsys.readouterr().out
    assert not lock.exists() and f"[grpo] removed {lock}: a JIT build lock whose builder is gone" in out
    assert "[grpo] building DeepSpeed's deepspeed_shm_comm op into" in out  # what the next minute is

    lock.write_text("")
    builder = subprocess.Popen([sys.executable, "-c", "import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                                "print('open', flush=True); sys.stdin.read()", str(lock)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "open"
        assert jit_cache.lock_holders(lock) == [builder.pid]
        jit_cache.check_jit_cache(cfg, 0)  # a build running on this machine: left to torch, which waits for it
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()

    # a cache shared with other machines: waited for, then named with the command that clears it
    monkeypatch.setattr(jit_cache, "on_local_filesystem", lambda path: False)
    with pytest.raises(ValueError, match=re.escape(f"held by no process on this machine for 0 s, left by a launch "
                                                   f"killed while it built; if no other node builds into this "
                                                   f"cache, rm {lock}")):
        jit_cache.clear_stale_build_lock(lock, speak=True, wait_s=0.3)
    threading.Timer(0.5, lock.unlink).start()  # another node's build ends
    jit_cache.clear_stale_build_lock(lock, speak=True, wait_s=30)
    assert "another node building into a shared cache?" in capsys.readouterr().out


def test_an_unwritable_jit_cache_is_one_line(tmp_path, monkeypatch, files):
    cfg = train_grpo.deepspeed_config(train_grpo.parse_args([]), 1)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(files / "a_file" / "ext"))
    with pytest.raises(ValueError, match=re.escape(f"the JIT extension cache {files}/a_file/ext is not writable")):
        jit_cache.check_jit_cache(cfg, 0)
    # on CUDA nothing is JIT-built by default (torch's fused AdamW); optimizer offload builds CPU Adam
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert jit_cache.jit_ops(train_grpo.deepspeed_config(train_grpo.parse_args([]), 1)) == []
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert jit_cache.jit_ops(cfg) == ["cpu_adam"]


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
    import length_drift

    run = tmp_path / "abl" / "lab-balanced-s1"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"agg": "balanced"}))
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
         (["--out", "/nonexistent/b.json"], "must be a file in an existing directory")]


@pytest.mark.parametrize("flags,message", BENCH, ids=[" ".join(f) for f, _ in BENCH])
def test_bench_step_checks_its_arguments_before_any_engine(flags, message, monkeypatch, capsys):
    import bench_step

    monkeypatch.setattr(sys, "argv", ["bench_step.py", *flags])
    with pytest.raises(SystemExit):
        bench_step.parse_args()
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and err.splitlines()[-1].startswith("bench_step.py: error: ")


def test_ablation_refuses_a_file_as_its_output_and_seeds_out_of_range(files, monkeypatch, capsys):
    import ablation

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
