"""Two "nodes" on one machine (torchrun --nnodes 2, one rank each, one rendezvous on 127.0.0.1) train the
lab policy exactly as one node of 2 ranks does, and resume from the checkpoint written across them.
Both run under tests/collective_probe.py: every collective of the project goes through the helper that
places it on the backend's device, and every engine is built by vLLM's external-launcher executor,
the construction path the CUDA branch takes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, cpu_env, deepspeed_run
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

STEPS = 3
LAB = ["--model", "lab", "--agg", "balanced", "--prompts-per-step", "8", "--group-size", "4",
       "--micro-batch-size", "4", "--minibatches", "2", "--max-response-len", "40", "--eval-interval", "100",
       "--eval-limit", "16", "--eval-samples", "2", "--gradient-checkpointing"]


# one thread per rank in both layouts (pin_cpu_rank would give a rank of one node of 2 ranks one core, a rank of a
# "node" of its own both): the CPU's GEMMs sum a weight gradient over the tokens in an order that can change with
# the thread count, which a packed row's shapes show in the last bits, and Adam's first steps magnify on weights
# whose gradient is near 0; what is compared is the distributed run, not the BLAS
ONE_THREAD = cpu_env(OMP_NUM_THREADS="1")


def two_nodes(out: Path, *extra: str, port: int = 29643) -> list[subprocess.CompletedProcess]:
    torchrun = Path(sys.executable).parent / "torchrun"
    procs = [subprocess.Popen([str(torchrun), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                               "--master_addr", "127.0.0.1", "--master_port", str(port),
                               "tests/collective_probe.py", *LAB, "--output-dir", str(out), *extra],
                              cwd=ROOT, env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return results


def metrics(out: Path) -> list[dict]:
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["step"] >= 1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    single, multi = root / "single", root / "multi"
    res = deepspeed_run(2, "tests/collective_probe.py", *LAB, "--steps", str(STEPS), "--save-interval", "100",
                        "--output-dir", str(single), port=29641, env=ONE_THREAD)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    first = two_nodes(multi, "--steps", "2", "--save-interval", "1")
    assert all(r.returncode == 0 for r in first), "\n".join(r.stdout[-2000:] + r.stderr[-2000:] for r in first)
    resumed = two_nodes(multi, "--steps", str(STEPS), "--save-interval", "100")
    assert all(r.returncode == 0 for r in resumed), "\n".join(r.stdout[-2000:] + r.stderr[-2000:] for r in resumed)
    return single, multi, resumed


def test_engines_are_built_by_the_external_launcher_on_their_local_rank(runs):
    single, multi, _ = runs
    for out, local_ranks in ((single, [0, 1]), (multi, [0, 0])):
        probes = [json.loads((out / f"probe_rank{r}.json").read_text()) for r in (0, 1)]
        assert [p["backend"] for p in probes] == ["external_launcher"] * 2
        assert [p["executor"] for p in probes] == ["ExecutorWithExternalLauncher"] * 2
        assert [p["local_rank"] for p in probes] == local_ranks and [p["world"] for p in probes] == [2, 2]
        assert [p["device"] for p in probes] == ["cpu", "cpu"]
        # vLLM's worker reseeded Python, NumPy and torch; the trainer put its own states back before training
        assert all(p["rng_at_resume"] == p["rng_at_build"] != p["rng_after_vllm"] for p in probes), probes


def test_two_nodes_resume_from_their_checkpoint_and_only_rank_0_logs(runs):
    _, multi, resumed = runs
    assert "resuming from" in resumed[0].stdout and "(step 2)" in resumed[0].stdout
    assert resumed[1].stdout.strip() == ""  # the second node's rank prints nothing
    assert [m["step"] for m in metrics(multi)] == [1, 2, 3]  # one line a step: one writer
    assert sorted(p.name for p in multi.iterdir()) == ["args.json", "checkpoints", "eval", "metrics.jsonl",
                                                       "probe_rank0.json", "probe_rank1.json", "run.lock", "tb"]
    assert (multi / "run.lock").read_text().startswith("pid ")  # one lock per run: global rank 0's


def test_two_nodes_equal_one_node_of_two_ranks(runs):
    single, multi, _ = runs
    a, b = metrics(single), metrics(multi)
    for key in ("reward/mean", "length/mean", "loss/pg"):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-5, abs=1e-7), key
    from data.demo import model_dir

    start = load_file(Path(model_dir("lab")) / "model.safetensors")
    one = load_file(single / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")
    two = load_file(multi / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")
    d1 = torch.cat([(one[k].float() - start[k].float()).flatten() for k in sorted(one)])
    d2 = torch.cat([(two[k].float() - start[k].float()).flatten() for k in sorted(one)])
    assert d1.abs().max() > 1e-6  # the runs trained
    atol = 1e-5 * float(d1.abs().max()) + 2 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(d2, d1, rtol=1e-4, atol=atol)
