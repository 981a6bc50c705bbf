"""Every collective on the device its backend serves: the project's collectives all go through
distributed.all_reduce / all_gather_objects, checked in the source (every file) and at run time
(tests/collective_probe.py's guard, on a real 1-rank gloo group here and on the 2-rank and 2-node
runs of tests/test_multinode.py)."""

import ast
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from collective_probe import ALLOWED, COLLECTIVES, install_guard
from conftest import ROOT

SKIP = {".venv", ".cache", "runs", ".git", "tests"}  # tests/ holds CPU-only probes that reduce on purpose


def collective_calls(source: str, filename: str) -> list[tuple[str, str, int]]:
    """(file, enclosing function, line) of every call of a torch.distributed collective in `source`:
    `dist.X(...)`, `torch.distributed.X(...)`, or X imported from torch.distributed."""
    tree = ast.parse(source)
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and n.module == "torch.distributed" for a in n.names if a.name in COLLECTIVES}
    found = []

    def visit(node, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call):
                f = child.func
                hit = (isinstance(f, ast.Attribute) and f.attr in COLLECTIVES
                       and ast.unparse(f.value) in ("dist", "torch.distributed")) \
                    or (isinstance(f, ast.Name) and f.id in imported)
                if hit:
                    found.append((filename, func, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def project_files() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts)]


def test_every_collective_of_the_project_goes_through_one_place():
    calls = [c for p in project_files() for c in collective_calls(p.read_text(), str(p.relative_to(ROOT)))]
    assert {c[:2] for c in calls} == ALLOWED, [c for c in calls if c[:2] not in ALLOWED]


def test_the_source_check_catches_a_cpu_tensor_reduction_put_back():
    # the trainer's max-length reduction as it was before: a CPU tensor handed to all_reduce (the metrics are
    # in grpo_utils/metrics.py, which calls distributed.all_reduce)
    source = (ROOT / "grpo_utils" / "metrics.py").read_text()
    new = '"length/max": all_reduce([max(r["length"] for r in rollouts)], "max").item(),'
    old = '"length/max": (dist.all_reduce(m := torch.tensor([max(r["length"] for r in rollouts)])) or m).item(),'
    assert new in source
    calls = collective_calls(source.replace(new, old), "grpo_utils/metrics.py")
    assert [c[1] for c in calls if c[:2] not in ALLOWED] == ["step_metrics"]


@pytest.fixture
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    yield
    for name, fn in saved.items():
        setattr(dist, name, fn)
    dist.destroy_process_group()


def test_run_time_guard_rejects_a_direct_collective_and_passes_the_helpers(one_rank_group):
    from grpo_utils import distributed

    install_guard()
    assert distributed.collective_device() == torch.device("cpu")  # gloo serves the CPU
    assert distributed.all_reduce([1.0, 2.0], op="max").tolist() == [1.0, 2.0]
    assert distributed.all_gather_objects({"a": 1}) == [{"a": 1}]
    with pytest.raises(RuntimeError, match=r"collective all_reduce called at tests/test_collectives.py"):
        dist.all_reduce(torch.zeros(1))  # as the project's code: a CPU tensor straight to the backend
