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
from conftest import BENCHMARKS, ROOT, cpu_env

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
    (["--lr=-1e-4"], "--lr must be > 0 (got -0.0001)"),
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
    one_line_error(run("ablation.py", *out, "--", "--lr", "-1"), "--lr must be > 0")
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


def test_a_launch_that_trained_nothing_binds_no_arguments(tmp_path):
    # args.json is written with the first checkpoint: a launch that failed before it (here after the
    # rendezvous) leaves nothing that refuses the corrected command, with other arguments
    out = ["--output-dir", str(tmp_path / "run")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    one_line_error(run("train_grpo.py", "--dataset", str(bad), *out), "has no 'answer'")
    one_line_error(run("train_grpo.py", "--dataset", str(bad), "--agg", "token", *out), "has no 'answer'")


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
    for s in range(1, steps + 1):
        ck = root / "checkpoints" / f"step_{s:06d}" / "state"
        ck.mkdir(parents=True)
        (ck.parent / "trainer_state.json").write_text(json.dumps({"step": s, "order": [], "bad_streak": 0}))
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


def test_finished_run_relaunched_with_resume_and_other_arguments_keeps_its_record(tmp_path):
    checkpointed_run(tmp_path / "run", steps=2)
    before = (tmp_path / "run" / "args.json").read_bytes()
    # a trailing slash is the same run; --resume with another rule trains nothing, so nothing is rewritten
    res = run("train_grpo.py", "--output-dir", f"{tmp_path / 'run'}/", "--steps", "2")
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr[-2000:]
    res = run("train_grpo.py", "--output-dir", str(tmp_path / "run"), "--steps", "2", "--resume", "--agg", "token")
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr[-2000:]
    assert (tmp_path / "run" / "args.json").read_bytes() == before
    moved = tmp_path / "moved"
    os.rename(tmp_path / "run", moved)  # a moved run directory is the same run
    res = run("train_grpo.py", "--output-dir", str(moved), "--steps", "2")
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr[-2000:]
