"""A change to the algorithm in one place reaches every tool.

A fork adds a leave-one-out advantage (A_i = r_i - mean of the group's other rewards) as a fork would: a
flag and a branch in train_grpo.advantages. The analysis tools read a run's recorded arguments and call the
trainer's functions with them, so on a run trained with the flag their numbers change with the trainer's;
on the project as it is, the same recorded flag is unknown to the trainer and changes nothing.
"""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, cpu_env

FLAG = '''    a("--no-std-norm", action="store_true", help="A = r - mean (Dr. GRPO): do not divide by the group std")
'''
LOO_FLAG = FLAG + '''    a("--leave-one-out", action="store_true", help="A_i = r_i - mean of the group's other rewards")
'''
ADVANTAGES = '''    return group_advantages(rewards, args.group_size, scale_by_std=not args.no_std_norm)
'''
LOO_ADVANTAGES = '''    if args.leave_one_out:
        r = rewards.view(-1, args.group_size)
        return (r - (r.sum(dim=1, keepdim=True) - r) / (args.group_size - 1)).view(-1)
''' + ADVANTAGES

def tool_numbers(project, tmp_path) -> dict:
    runs = tmp_path / f"runs-{project.name}"
    runs.mkdir()
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "tool_numbers.py"), str(runs)], cwd=project,
                         capture_output=True, text=True, timeout=300, env=cpu_env())
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def fork(tmp_path):
    """A copy of the project with the leave-one-out edit in train_grpo.py (data/ and sandboxed/ linked)."""
    copy = tmp_path / "fork"
    copy.mkdir()
    for name in ("train_grpo.py", "rewards.py", "evaluate.py", "ds_config.json"):
        shutil.copy(ROOT / name, copy / name)
    for name in ("grpo_utils", "scripts"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("data", "sandboxed", ".cache"):
        if (ROOT / name).exists():
            (copy / name).symlink_to(ROOT / name)
    trainer = (copy / "train_grpo.py").read_text()
    assert trainer.count(FLAG) == 1 and trainer.count(ADVANTAGES) == 1, "the edit's anchors moved"
    (copy / "train_grpo.py").write_text(trainer.replace(FLAG, LOO_FLAG).replace(ADVANTAGES, LOO_ADVANTAGES))
    return copy


@pytest.mark.slow
def test_a_leave_one_out_advantage_in_the_trainer_reaches_every_tool(tmp_path):
    forked = tool_numbers(fork(tmp_path), tmp_path)
    assert all(a != pytest.approx(b, rel=1e-6) for a, b in zip(forked["False"], forked["True"])), forked
    assert forked["bench_step"] is False  # the benchmark's run has the fork's flag, at its default
    as_is = tool_numbers(ROOT, tmp_path)  # the flag recorded, but no trainer of this project reads it
    assert as_is["False"] == as_is["True"] == forked["False"], (as_is, forked)
    assert as_is["bench_step"] is None


def test_no_script_imports_the_tests():
    # the tools run from a clone without its tests/ (a fork that drops them, a wheel): what they share with the
    # tests lives beside the code (data/reward_cases.py), not in tests/
    import ast

    from conftest import ROOT

    for path in (ROOT / "scripts").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "tests" or n.startswith("tests.") for n in names), f"{path.name} imports {names}"


def test_the_trainer_never_changes_its_arguments_after_parsing():
    # args is what was parsed: outside parse_args no function of the trainer or its plumbing assigns an attribute
    # of `args`, setattr()s one or updates vars(args). What a run learns (its micro-batch sizes: recorded, or the
    # budget measured at its first update; the pad token) lives in batching.micro_batching's namespace.
    import ast

    from conftest import ROOT

    for path in [ROOT / "train_grpo.py", *sorted((ROOT / "grpo_utils").glob("*.py"))]:
        name = path.name
        for fn in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)):
            if fn.name == "parse_args":
                continue
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                targets = [t for x in targets for t in (x.elts if isinstance(x, ast.Tuple) else [x])]
                changed = any(isinstance(t, ast.Attribute) and ast.unparse(t.value) == "args" for t in targets)
                if isinstance(node, ast.Call):
                    call = ast.unparse(node.func)
                    changed = (call == "setattr" and ast.unparse(node.args[0]) == "args") or \
                        call == "vars(args).update"
                assert not changed, f"{name}:{node.lineno} ({fn.name}) changes args after parsing"
