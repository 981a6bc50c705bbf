"""Crash safety: exact resume after SIGKILL (in a step and in a save), the non-finite guard,
degenerate batches, and one-line errors before any expensive work."""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, check_output_dir, cpu_env, deepspeed_run, wandb_log
from safetensors.torch import load_file

import train_grpo
from data import loading
from grpo_utils import checkpoints, distributed
from grpo_utils.flags import flags_with

RUN = ["--steps", "5", "--save-interval", "2", "--prompts-per-step", "8", "--group-size", "4", "--minibatches", "2",
       "--micro-batch-size", "4", "--eval-limit", "4", "--eval-interval", "100", "--lr", "1e-3",
       "--lr-warmup-steps", "4",  # the schedule's position must survive a resume too
       "--dynamic-sampling"]  # and the data order after a step's extra sampling rounds


def train(out, *extra, env=None, port=29630, script="train_grpo.py"):
    return deepspeed_run(2, script, "--output-dir", str(out), *RUN, *extra, port=port, env=env)


def metrics(out) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timings = ("time/", "perf/")  # seconds and rates: they vary between runs
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(timings)} for r in rows}


@pytest.fixture(scope="module")
def reference_run(demo_dir, tmp_path_factory):
    """The uninterrupted run, saving every step and keeping the last 2 states (the others save every 2nd
    step: how often a run saves changes nothing it computes)."""
    out = tmp_path_factory.mktemp("crash") / "reference"
    res = train(out, "--save-interval", "1", "--keep-last", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    m = metrics(out)
    assert any(m[step]["sample/rounds"] > 1 for step in m if step > 0)  # a resume then redoes those rounds
    return out, m


@pytest.fixture
def reference(reference_run):
    return reference_run[1]


def assert_same_run(resumed: dict, reference: dict):
    assert sorted(resumed) == sorted(reference)
    for step in reference:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-9), step


@pytest.mark.slow
def test_sigkill_during_a_step_then_during_a_save_resumes_exactly(reference, tmp_path):
    """One run killed twice: in a step (the `deepspeed` command, SIGKILL to its process group), then in a
    save (its resume dies while writing step 4); the third launch ends it as the uninterrupted run."""
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    wandb = ["--report-to", "tensorboard", "wandb"]  # offline: written to out/wandb/, read back below
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", "29631",
           "train_grpo.py", "--output-dir", str(out), *RUN, *wandb]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cpu_env(WANDB_MODE="offline"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:  # wait until the step-2 checkpoint exists
        if (ckpts / "latest").exists() and (out / "metrics.jsonl").exists() and \
                len((out / "metrics.jsonl").read_text().splitlines()) >= 4:
            break
        time.sleep(0.2)
    time.sleep(random.uniform(0.0, 0.3))  # somewhere in step 4 (a demo step takes about 0.6 s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (ckpts / "latest").exists()
    assert not (ckpts / "step_000005").exists()  # killed before the end: a real resume follows
    # the checkpoint a resume takes: step 2's, or step 4's where the kill came after its save (possibly after
    # its rename and before `latest` names it)
    newest = int(checkpoints.resumable_checkpoints(ckpts, 2)[0].name[5:])
    assert newest in (2, 4)
    saved = f"step_{newest:06d}"

    # the same command again resumes by itself, and is killed in its first save (step 4's, or the last)
    kill = min(newest + 2, 5)
    res = train(out, *wandb, env=cpu_env(GRPO_FAULT_KILL_IN_SAVE=str(kill), WANDB_MODE="offline"), port=29632,
                script="tests/fault_train.py")
    assert res.returncode != 0
    assert "resuming from" in res.stdout and saved in res.stdout
    assert (ckpts / "latest").read_text() == saved
    assert (ckpts / f"step_{kill:06d}.tmp").is_dir() and not (ckpts / f"step_{kill:06d}").exists()

    res = train(out, "--resume", *wandb, env=cpu_env(WANDB_MODE="offline"), port=29634)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from" in res.stdout and saved in res.stdout
    assert_same_run(metrics(out), reference)
    assert not (ckpts / f"step_{kill:06d}.tmp").exists() and (ckpts / "latest").read_text() == "step_000005"

    # wandb: each launch continued the same run, the last one from the step after the checkpoint
    run_id = (out / "wandb_id").read_text()
    launches = sorted(out.glob("wandb/offline-run-*"))
    assert len(launches) == 3 and all(p.name.endswith(f"-{run_id}") for p in launches)
    last = wandb_log(next(launches[2].glob("run-*.wandb")))
    # (the killed launches' logs are cut: their records end where the trainer died)
    assert last["run_id"] == run_id and last["config"]["agg"] == "balanced"
    assert [h["train/step"] for h in last["history"]] == list(range(newest + 1, 6))
    final = metrics(out)
    for h in last["history"]:
        assert h["loss/pg"] == pytest.approx(final[h["train/step"]]["loss/pg"], rel=1e-12, abs=1e-15)


@pytest.mark.slow
def test_a_lora_run_resumes_exactly(demo_dir, tmp_path):
    """--lora-rank: a run stopped after its checkpoint at step 2 and resumed logs the uninterrupted run's step 3
    and exports its merged weights, the adapters and their optimizer states restored from the checkpoint; with a
    KL term, whose reference is the base, the policy with its adapters off."""
    lora = ["--lora-rank", "2", "--save-interval", "2", "--kl-coef", "0.01", "--steps", "3"]
    assert train(tmp_path / "whole", *lora).returncode == 0
    # the run as a kill after step 2's checkpoint leaves it: what came after is not there
    shutil.copytree(tmp_path / "whole", tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step_000003")
    (tmp_path / "split" / "checkpoints" / "latest").write_text("step_000002")
    res = train(tmp_path / "split", *lora, "--resume", port=29638)
    assert res.returncode == 0 and "resuming from" in res.stdout and "step_000002 (step 2)" in res.stdout, \
        res.stderr[-3000:]
    whole, split = ({s: {k: v for k, v in m.items() if not k.startswith("eval/")} for s, m in metrics(d).items()}
                    for d in (tmp_path / "whole", tmp_path / "split"))
    assert_same_run(split, whole)
    assert whole[3]["loss/pg"] != 0 and whole[3]["train/no_signal"] == 0  # step 3 trained
    assert whole[3]["loss/ref_kl"] > 0  # two steps away from the base
    exported = [load_file(d / "checkpoints" / "step_000003" / "model.safetensors") for d in (tmp_path / "whole",
                                                                                            tmp_path / "split")]
    assert exported[0].keys() == exported[1].keys() and not any("lora" in k for k in exported[0])
    for k in exported[0]:
        torch.testing.assert_close(exported[1][k], exported[0][k], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_keep_last_prunes_states_and_resume_skips_a_damaged_checkpoint(reference_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference_run[0], out)
    ckpts = out / "checkpoints"
    assert [p.parent.name for p in sorted(ckpts.glob("step_*/state"))] == ["step_000004", "step_000005"]
    assert not (ckpts / "step_000003" / "state").exists() and (ckpts / "step_000003" / "model.safetensors").exists()

    # The newest checkpoint damaged (a cut optimizer shard of rank 1) and `latest` emptied: the same
    # command resumes from the one before, names what it skipped, and redoes step 5 only, exactly. The
    # user's own copies beside the checkpoints are neither resumed from (step_best sorts after
    # step_000005) nor pruned (step_000004.bak sorts between step_000004 and step_000005).
    shard = next((ckpts / "step_000005" / "state").glob("*rank_1_*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (ckpts / "latest").write_text("")
    shutil.copytree(ckpts / "step_000004", ckpts / "step_best")
    shutil.copytree(ckpts / "step_000004", ckpts / "step_000004.bak")
    res = train(out, "--save-interval", "1", "--keep-last", "2", port=29637)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"skipping incomplete checkpoint(s): step_000005 (state/{shard.name} is damaged" in res.stdout
    assert "resuming from" in res.stdout and "step_000004 (step 4)" in res.stdout
    assert_same_run(metrics(out), reference_run[1])
    assert all((ckpts / name / "state").is_dir() for name in ("step_000004", "step_000005", "step_000004.bak"))


# every flag --resume may change, its new value, and what shows the resumed step used it (beyond hparams/FLAG,
# which the step logs): the rate and weight decay as the optimizer holds them (a checkpoint's optimizer and
# scheduler states once carried the old ones over the flags), the policy's module, the step's own metrics and files
RESUMED = {"lr": "5e-4", "lr_warmup_steps": "10", "weight_decay": "0.05", "clip_eps_low": "0.1",
           "clip_eps_high": "0.2", "kl_coef": "0.01", "max_response_len": "10", "temperature": "0.7", "top_p": "0.9",
           "eval_dataset": "demo", "eval_samples": "2", "eval_limit": "3", "rollout_correction_cap": "3",
           "micro_batch_size": "2", "gradient_checkpointing": None, "logprob_chunk": "64"}
# SAPO's temperatures are read where the clip bounds are (policy_loss_per_token's arguments, from args at every
# step); a PPO run refuses them, and a run's policy loss is its identity
OTHER_LOSS = {"sapo_tau_pos", "sapo_tau_neg"}


@pytest.mark.slow
def test_every_flag_a_resume_may_change_takes_effect(reference_run, demo_dir, tmp_path):
    assert set(RESUMED) | OTHER_LOSS == flags_with("resume")  # a new resume flag is added here
    assert OTHER_LOSS <= {k for p in train_grpo.POLICY_LOSS_DEFAULTS.values() for k in p}
    out = tmp_path / "run"
    shutil.copytree(reference_run[0], out)
    flags = [x for k, v in RESUMED.items() for x in ("--" + k.replace("_", "-"), *([v] if v else []))]
    res = train(out, "--save-interval", "1", "--keep-last", "2", "--steps", "6", "--resume", *flags, port=29645)
    assert res.returncode == 0, res.stderr[-3000:]
    m = metrics(out)
    assert m[5] == pytest.approx(reference_run[1][5])  # resumed from step 5, as it was
    logged = {k.removeprefix("hparams/"): v for k, v in m[6].items() if k.startswith("hparams/")}
    assert logged == pytest.approx({k: float(v or 1) for k, v in RESUMED.items() if k != "eval_dataset"})
    # the rate: 5e-4 x the 10-step warm-up's factor at the updates the checkpoint had applied
    state = torch.load(next((out / "checkpoints" / "step_000005").glob("state/**/*mp_rank_00_model_states.pt")),
                       weights_only=False, map_location="cpu")
    done = state["global_steps"] - state["skipped_steps"]
    assert 0 < done < 20 and m[6]["lr"] == pytest.approx(5e-4 * (done + 1) / 20)
    assert m[5]["lr"] == pytest.approx(1e-3) and m[5]["hparams/weight_decay"] == 0.0
    assert m[6]["train/micro_batches"] == 2 * m[5]["train/micro_batches"] == 4  # 8 responses a rank, 2 a row
    assert m[6]["length/max"] <= 10
    assert "eval/acc@2" in m[6] and "eval/acc@4" not in m[6]
    ids = [json.loads(x)["id"] for x in (out / "eval" / "step_000006.jsonl").read_text().splitlines()]
    train_ids = {json.loads(x)["id"] for x in (demo_dir / "train.jsonl").read_text().splitlines()}
    assert len(ids) == 3 and set(ids) <= train_ids  # --eval-dataset demo: the training prompts


@pytest.mark.slow
def test_a_resume_cuts_the_micro_batches_its_run_recorded(reference_run, tmp_path):
    # every checkpoint records the sizes its micro-batches were cut by (on CUDA the token budget measured at the
    # run's first update); a launch that gives none of them goes on with those, not with a budget measured anew
    out = tmp_path / "run"
    shutil.copytree(reference_run[0], out)
    ckpts = out / "checkpoints"
    state = json.loads((ckpts / "step_000005" / "trainer_state.json").read_text())
    assert state["sizes"] == {"device": "cpu", "micro_batch_size": 4, "micro_batch_tokens": 0,
                              "logprob_batch_size": 16}
    recorded = {"device": "cpu", "micro_batch_size": None, "micro_batch_tokens": 37, "logprob_batch_size": None}
    (ckpts / "step_000005" / "trainer_state.json").write_text(json.dumps({**state, "sizes": recorded}))
    flags = dict(zip(RUN[:-1:2], RUN[1::2]))
    assert RUN == [*(x for kv in flags.items() for x in kv), "--dynamic-sampling"]
    del flags["--micro-batch-size"]  # the sizes are not given
    res = deepspeed_run(2, "train_grpo.py", "--output-dir", str(out), *(x for kv in flags.items() for x in kv),
                        "--dynamic-sampling", "--steps", "6", port=29638)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("[grpo] micro-batches as the run recorded them: --logprob-batch-size None, --micro-batch-size None, "
            "--micro-batch-tokens 37") in res.stdout
    assert json.loads((ckpts / "step_000006" / "trainer_state.json").read_text())["sizes"] == recorded
    # 8 responses of about 20-40 tokens per rank and mini-batch: cut by 37 tokens, not by rows of 4
    assert metrics(out)[6]["train/micro_batches"] > 2 == metrics(out)[5]["train/micro_batches"]


@pytest.mark.slow
@pytest.mark.parametrize("fault,port", [("UNFILE", 29639), ("STALL", 29641)])
def test_a_rank_killed_in_a_step_is_named_with_the_checkpoint_to_resume_from(fault, port, tmp_path, demo_dir):
    """Rank 1 SIGKILLed in step 3 (as the OOM killer ends a rank): under the real launcher the launch ends in one
    line naming it and where the same command resumes, not in the survivor's traceback of a broken collective.
    UNFILE: its .rank1.pid removed by hand before (a file left by the killed rank: test_a_rank_gone_with_its_file_...).
    STALL: rank 0 blocked meanwhile in a C call that never returns to Python, as a survivor under NCCL waits in a
    CUDA synchronisation on a collective's kernel: neither a collective's error nor the launcher's SIGTERM reaches
    its main thread, and the rank watcher (distributed.watch_ranks) names the death."""
    out = tmp_path / "run"
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
           "tests/fault_train.py", "--output-dir", str(out), *RUN, "--steps", "4"]
    res = subprocess.run(cmd, cwd=ROOT, env=cpu_env(GRPO_FAULT_KILL_RANK="1:3", **{f"GRPO_FAULT_{fault}": "1"}),
                         capture_output=True, text=True, timeout=600)
    said = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in said, said[-3000:]
    lines = [x for x in said.splitlines() if x.startswith("train_grpo.py")]
    assert len(lines) == 1 and re.fullmatch(
        r"train_grpo.py: error: rank 1 \(pid \d+\) died during step 3 \(killed by a signal, e.g. the OOM killer\); "
        f"the same command resumes the run from {re.escape(str(out))}/checkpoints/step_000002 \\(step 2\\)",
        lines[0]), said[-3000:]
    assert (out / ".rank0.pid").read_text() == distributed.ENDED  # the survivor ended on its own
    # the dead rank's file as the fault left it: removed by hand, or unmarked
    assert not (out / ".rank1.pid").exists() if fault == "UNFILE" else \
        (out / ".rank1.pid").read_text() != distributed.ENDED


def test_the_collective_timeout_is_set_on_purpose_and_a_user_may_change_it(monkeypatch):
    import datetime

    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)  # DeepSpeed's default is 10 minutes
    assert distributed.collective_timeout() == datetime.timedelta(minutes=distributed.COLLECTIVE_TIMEOUT_MIN) > \
        datetime.timedelta(minutes=10)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "90")
    assert distributed.collective_timeout() == datetime.timedelta(minutes=90)


def test_a_finished_rank_is_never_taken_for_dead_and_the_last_to_end_removes_the_files(tmp_path, monkeypatch):
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    host = socket.gethostname()
    monkeypatch.setattr(distributed, "LAUNCH", {"ranks": [(os.getpid(), host), (finished.pid, host)], "rank": 1,
                                             "out_dir": tmp_path, "step": 3})
    for r in range(2):
        distributed.rank_file(tmp_path, r).write_text("pid\n")
    distributed.forget_rank(done=True)  # rank 1 done first: its file marked, rank 0's still running
    monkeypatch.setitem(distributed.LAUNCH, "rank", 0)
    assert distributed.rank_file(tmp_path, 1).read_text() == distributed.ENDED and distributed.dead_ranks() == ([], [1])
    distributed.forget_rank(done=True)  # the last: every file marked, so every file removed
    assert not list(tmp_path.glob(".rank*"))


def test_a_rank_gone_with_its_file_unmarked_died_and_one_that_marked_it_ended(tmp_path, monkeypatch):
    killed, unfiled = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = socket.gethostname()
    ranks = [(os.getpid(), host), (killed.pid, host), (ended.pid, host), (killed.pid, "another-node"),
             (unfiled.pid, host)]
    monkeypatch.setattr(distributed, "LAUNCH", {"ranks": ranks, "rank": 0, "out_dir": tmp_path, "step": 3})
    for r in range(5):
        distributed.rank_file(tmp_path, r).write_text(f"pid {ranks[r][0]} on {ranks[r][1]}\n")
    distributed.rank_file(tmp_path, 2).write_text(distributed.ENDED)  # as ends_in_one_line marks it, however it ends
    distributed.rank_file(tmp_path, 4).unlink()  # removed by hand: its death is still a death without a word
    assert distributed.dead_ranks() == ([], [2])
    for p in (killed, unfiled):
        p.kill()
    deadline = time.time() + 10
    while not all(map(distributed.process_gone, (killed.pid, unfiled.pid))) and time.time() < deadline:
        time.sleep(0.01)  # unreaped: a zombie, as a launcher's rank is until it polls
    assert distributed.dead_ranks() == ([1, 4], [2])  # (rank 3, on another node, cannot be seen from here)
    killed.wait(), unfiled.wait()
    assert distributed.dead_ranks() == ([1, 4], [2])


@pytest.mark.slow
def test_non_finite_step_is_skipped_and_too_many_stop_the_run(tmp_path, demo_dir):
    out = tmp_path / "run"
    res = train(out, "--save-interval", "1", "--max-bad-steps", "1", env=cpu_env(GRPO_FAULT_NAN_STEP="2"),
                port=29636, script="tests/fault_train.py")
    assert res.returncode != 0
    assert "1 steps in a row had a non-finite loss or gradient" in res.stderr and "Traceback" not in res.stderr
    m = metrics(out)
    assert m[2]["train/skipped_updates"] == 2 and m[1]["train/skipped_updates"] == 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000002"  # stopped with a valid checkpoint
    before = load_file(ckpts / "step_000001" / "model.safetensors")
    after = load_file(ckpts / "step_000002" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)  # the poisoned step changed nothing
    initial = load_file(demo_dir / "model" / "model.safetensors")
    assert not all(torch.equal(before[k], initial[k].to(before[k].dtype)) for k in before)  # step 1 did train


@pytest.mark.slow
def test_degenerate_batches(tmp_path, demo_dir):
    """One run where nothing can be learned, for two reasons at once: every reference answer is unreachable,
    and every response is cut at 2 tokens (too short for any answer) and masked; prompts over the length limit
    are dropped and counted. Nothing is updated, so this is not a check of what the mask does to a loss."""
    rows = [json.loads(x) for x in (demo_dir / "train.jsonl").read_text().splitlines()[:80]]
    data = tmp_path / "hopeless.jsonl"
    data.write_text("".join(json.dumps({**r, "answer": "-1"}) + "\n" for r in rows))
    out = tmp_path / "zero"
    res = train(out, "--dataset", str(data), "--steps", "2", "--max-response-len", "2", "--mask-truncated",
                "--max-prompt-len", "13", port=29637)
    assert res.returncode == 0, res.stderr[-3000:]
    m = metrics(out)
    for step in (1, 2):  # all rewards 0: no group has reward variance, and the step is skipped
        assert m[step]["train/no_signal"] == 1.0 and m[step]["groups/zero_var_share"] == 1.0
        assert m[step]["length/truncation_rate"] == 1.0 and m[step]["loss/pg"] == 0.0
    dropped = int(res.stdout.split("training prompts (")[1].split(" too long")[0])
    assert 0 < dropped < 80 - 8
    # held-out prompts too (once dropped unsaid): as many as the trainer's loader drops before --eval-limit's 4
    from transformers import AutoTokenizer

    args = train_grpo.parse_args(["--max-prompt-len", "13", "--eval-limit", "4"])
    held_out = loading.load_prompts("demo-test", AutoTokenizer.from_pretrained(demo_dir / "model"), args, 4)[1]
    assert f"eval prompts ({held_out} too long, dropped)" in res.stdout and held_out > 0
    final = load_file(out / "checkpoints" / "step_000002" / "model.safetensors")
    initial = load_file(demo_dir / "model" / "model.safetensors")
    # skipped, not nudged by AdamW (the shipped weights are bf16; the CPU trainer exports fp32)
    assert all(torch.equal(final[k], initial[k].to(final[k].dtype)) for k in final)


ONE_RANK = ["--steps", "40", "--save-interval", "1", "--prompts-per-step", "8", "--group-size", "4", "--minibatches",
            "2", "--micro-batch-size", "4", "--eval-limit", "4", "--eval-interval", "100"]


def lines_of(out) -> tuple[list[int], list[int]]:
    """The steps of metrics.jsonl's lines and of TensorBoard's reward/mean, as a reader sees them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    return steps, [e.step for e in acc.Scalars("reward/mean")]


@pytest.mark.slow
def test_one_writer_and_every_early_end_in_one_line(tmp_path, demo_dir):
    """A second launch into a running run's directory, Ctrl-C, and an update that makes the weights
    non-finite (plain `python train_grpo.py`, as a user runs it)."""
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    long_run = [*ONE_RANK, "--steps", "1000"]  # cannot end before the Ctrl-C (the step count may change per launch)
    first = subprocess.Popen([sys.executable, "train_grpo.py", "--output-dir", str(out), *long_run], cwd=ROOT,
                             env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             # Ctrl-C as at a terminal, also when the tests run in a background job (which
                             # ignores SIGINT, and so would its children: Python then raises nothing)
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 400
    while time.time() < deadline and first.poll() is None and not (ckpts / "step_000002").exists():
        time.sleep(0.2)
    second = run_cli("--output-dir", str(out), *ONE_RANK, env=cpu_env())
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert second.stderr.strip().splitlines() == [
        f"train_grpo.py: error: --output-dir {out} is in use by another launch (pid {first.pid} on "
        f"{socket.gethostname()}, since {second.stderr.split(', since ')[1].split(')')[0]}); wait for it to end, "
        "or use another --output-dir"]
    assert first.poll() is None  # untouched, still training

    first.send_signal(signal.SIGINT)  # Ctrl-C
    _, err = first.communicate(timeout=120)
    newest = max(int(p.name[5:]) for p in ckpts.iterdir() if p.name[5:].isdigit())
    assert first.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert [x for x in err.splitlines() if x.startswith("train_grpo.py")] == [
        f"train_grpo.py: interrupted; the same command resumes the run from {ckpts}/step_{newest:06d} (step {newest})"]

    # the same command again, with the first update from step newest+2 on at lr = inf: DeepSpeed applies it
    # (the gradients are finite), the second mini-batch's NaN gradient it skips; nothing of the step is saved
    res = run_cli("--output-dir", str(out), *long_run, env=cpu_env(GRPO_FAULT_INF_LR_STEP=str(newest + 2)),
                  script="tests/fault_train.py")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"resuming from {ckpts}/step_{newest:06d} (step {newest})" in res.stdout
    m = metrics(out)
    bad = max(m)
    assert bad >= newest + 2
    assert m[bad]["train/nonfinite_weights"] > 0 and m[bad]["train/skipped_updates"] == 1
    assert [x for x in res.stderr.splitlines() if "error:" in x] == [
        f"train_grpo.py: error: step {bad}'s update made {m[bad]['train/nonfinite_weights']} weights non-finite "
        f"(not saved); the same command resumes the run from {ckpts}/step_{bad - 1:06d} (step {bad - 1})"]
    assert not (ckpts / f"step_{bad:06d}").exists() and (ckpts / "latest").read_text() == f"step_{bad - 1:06d}"
    saved = load_file(ckpts / f"step_{bad - 1:06d}" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in saved.values())
    # one line per step in metrics.jsonl and one point per step in TensorBoard, over three launches
    assert lines_of(out) == (list(range(bad + 1)), list(range(1, bad + 1)))


@pytest.mark.slow
def test_a_full_disk_ends_in_one_line_and_keeps_the_newest_checkpoint(tmp_path, demo_dir):
    """The run directory on a 14 MiB filesystem (a demo checkpoint takes 9): step 2's save finds it full."""
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    mount = 'mount -t tmpfs -o size=14m tmpfs "$0" && { "$@"; rc=$?; cp -a "$0/run" "$COPY"; exit $rc; }'
    if subprocess.run(["unshare", "-rm", "sh", "-c", mount, str(disk), "true"], env={**os.environ, "COPY": "/"},
                      capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespace here (unshare -rm) to make a small filesystem in")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", mount, str(disk), sys.executable, "train_grpo.py",
                          "--output-dir", str(disk / "run"), *ONE_RANK, "--steps", "3"], cwd=ROOT,
                         env=cpu_env(COPY=str(copy)), capture_output=True, text=True, timeout=600)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    ckpts = disk / "run" / "checkpoints"
    assert [x for x in res.stderr.splitlines() if "error:" in x] == [
        f"train_grpo.py: error: no space left on {ckpts}: step_000002.tmp is incomplete (remove it, or the next "
        f"save at this step does); the same command resumes the run from {ckpts}/step_000001 (step 1)"]

    assert (copy / "checkpoints" / "latest").read_text() == "step_000001"
    assert checkpoints.checkpoint_problem(copy / "checkpoints" / "step_000001", 1) is None
    assert load_file(copy / "checkpoints" / "step_000001" / "model.safetensors")


@pytest.mark.slow
def test_a_disk_that_fills_between_checkpoints_ends_two_ranks_in_one_line(tmp_path, demo_dir):
    """2 ranks under the real launcher, the run directory on a 32 MiB filesystem that another process fills once
    step 1's checkpoint is in place: step 2's log write finds it full. One line, and neither TensorBoard's writer
    thread nor the other rank's broken collective adds a traceback."""
    disk = tmp_path / "disk"
    disk.mkdir()
    fill = ('(for i in $(seq 3000); do [ -s "$0/run/checkpoints/latest" ] && exec cat /dev/zero > "$0/fill"; '
            'sleep 0.1; done) >/dev/null 2>&1 &')
    mount = f'mount -t tmpfs -o size=32m tmpfs "$0" && {fill} "$@"'
    if subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs $0", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespace here (unshare -rm) to make a small filesystem in")
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", mount, str(disk), deepspeed, "--num_gpus", "2",
                          "--master_port", "29644", "train_grpo.py", "--output-dir", str(disk / "run"), *RUN,
                          "--save-interval", "1"], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                         timeout=600)
    said = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in said, said[-3000:]
    out = disk / "run"
    assert [x for x in said.splitlines() if "error:" in x] == [
        f"train_grpo.py: error: no space left on {out}; the same command resumes the run from "
        f"{out}/checkpoints/step_000001 (step 1)"], said[-3000:]


def run_cli(*flags, env=None, script="train_grpo.py"):
    return subprocess.run([sys.executable, script, *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow  # a trainer process: imports and a DeepSpeed start, 5-10 s
def test_unreadable_dataset(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"not a parquet file")
    res = run_cli("--dataset", str(bad), "--output-dir", str(tmp_path / "o"))
    assert res.returncode != 0 and "Traceback" not in res.stderr and "cannot read dataset" in res.stderr


def test_deepspeed_config_contradicting_the_flags(tmp_path):
    cfg = json.loads((ROOT / "ds_config.json").read_text())
    cfg["train_batch_size"] = 12345
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    res = run_cli("--ds-config", str(tmp_path / "ds.json"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "--ds-config sets train_batch_size=12345 but the flags imply" in res.stderr


def test_more_ranks_than_prompts():
    res = run_cli("--prompts-per-step", "2", env={**os.environ, "WORLD_SIZE": "4"})
    assert res.returncode != 0 and "smaller than the 4 ranks" in res.stderr


def test_output_dir_of_a_different_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text(json.dumps({"agg": "token", "lr": 1e-6}))
    res = run_cli("--output-dir", str(out), "--agg", "balanced")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "holds a run with other arguments (--agg token -> balanced" in res.stderr


def test_a_run_from_before_a_flag_existed_is_the_same_run(tmp_path):
    # an args.json written before --policy-loss, --dynamic-sampling, ... existed: those flags at their
    # defaults are the same run; at another value they are not
    args = train_grpo.parse_args(["--output-dir", str(tmp_path)])
    old = {k: v for k, v in vars(args).items()
           if k not in ("policy_loss", "sapo_tau_pos", "sapo_tau_neg", "dynamic_sampling", "max_sample_rounds",
                        "overlong_buffer", "overlong_penalty")}
    (tmp_path / "args.json").write_text(json.dumps(old))
    assert check_output_dir(args, tmp_path, world=1) == []
    with pytest.raises(ValueError, match="--dynamic-sampling False -> True"):
        check_output_dir(train_grpo.parse_args(["--output-dir", str(tmp_path), "--dynamic-sampling"]),
                                    tmp_path, world=1)
