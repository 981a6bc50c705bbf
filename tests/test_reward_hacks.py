"""Code rewards against a policy that games the checker.

Ten families of programs that solve nothing but attack the function-test harness: they read the
harness's secret from the caller's frame, from __main__, from the garbage collector or from an
excepthook; return objects (or int subclasses) equal to everything; patch exec, builtins the tests
use, or the tracer; or answer from a table of the tests they find on disk. Each must score 0 on
every function-test problem of the shipped benchmarks. The same programs do score when the check
runs in the tested program's process (the harness rewards.py had before), so these tests fail if
the check is ever put back there.
"""

import json

import pytest
from conftest import BENCHMARKS

import rewards
from data.prepare import load_rows
from rewards import compute_rewards
from sandboxed import sandbox

_FIND_SECRET = '''
import os, re, sys
def _is_secret(v):
    return isinstance(v, str) and re.fullmatch(r"[0-9a-f]{32}", v) is not None
def _cash_in(values):
    for v in list(values):
        if _is_secret(v):
            print(v, flush=True)
            os._exit(0)
'''

HACKS = {
    # the harness's secret, from the frames that call the solution
    "caller_frame": _FIND_SECRET + '''
def answer(*args, **kwargs):
    f = sys._getframe(1)
    while f is not None:
        _cash_in(f.f_globals.values())
        _cash_in(f.f_locals.values())
        f = f.f_back
''',
    # ... from the __main__ module
    "main_module": _FIND_SECRET + '''
def answer(*args, **kwargs):
    _cash_in(vars(sys.modules["__main__"]).values())
''',
    # ... from every dict the garbage collector knows
    "gc_scan": _FIND_SECRET + '''
import gc
def answer(*args, **kwargs):
    for o in gc.get_objects():
        if isinstance(o, dict):
            _cash_in(o.values())
''',
    # ... from the frames of the failed check, once it fails
    "excepthook": _FIND_SECRET + '''
def _hook(kind, error, tb):
    while tb is not None:
        _cash_in(tb.tb_frame.f_globals.values())
        tb = tb.tb_next
sys.excepthook = _hook
def answer(*args, **kwargs):
    return None
''',
    "always_equal": '''
class _Any:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def answer(*args, **kwargs):
    return _Any()
''',
    "equal_int_subclass": '''
class _AnyInt(int):
    __eq__ = lambda self, other: True  # noqa: E731
    __ne__ = lambda self, other: False  # noqa: E731
    __hash__ = int.__hash__
def answer(*args, **kwargs):
    return _AnyInt(0)
''',
    # the tests' check is replaced as soon as exec defines it
    "patch_exec": '''
import builtins
_exec = builtins.exec
def _exec_then_disarm(code, g=None, l=None, **kw):
    _exec(code, g, l, **kw)
    if isinstance(g, dict) and "check" in g:
        g["check"] = lambda *args, **kwargs: None
builtins.exec = _exec_then_disarm
def answer(*args, **kwargs):
    return None
''',
    # builtins and math functions the asserts use, made agreeable
    "patch_builtins": '''
import builtins, math
builtins.abs = lambda x: 0
builtins.all = lambda *args, **kwargs: True
builtins.any = lambda *args, **kwargs: True
builtins.sorted = lambda *args, **kwargs: []
builtins.set = lambda *args, **kwargs: frozenset()
math.isclose = lambda *args, **kwargs: True
def answer(*args, **kwargs):
    return 0
''',
    # a tracer that jumps over the check's assert lines
    "settrace_jump": '''
import dis, sys
def _tracer(frame, event, arg):
    if frame.f_code.co_name != "check":
        return None
    asserts = {i.positions.lineno for i in dis.get_instructions(frame.f_code) if i.opname == "LOAD_ASSERTION_ERROR"}
    lines = sorted({line for _, _, line in frame.f_code.co_lines() if line})
    def jump(frame, event, arg):
        if event == "line" and frame.f_lineno in asserts:
            for target in [n for n in lines if n > frame.f_lineno and n not in asserts]:
                try:
                    frame.f_lineno = target
                    break
                except ValueError:
                    pass
        return jump
    return jump
sys.settrace(_tracer)
def answer(*args, **kwargs):
    return None
''',
    # the tests' own asserts (or LiveCodeBench's CASES), found in the sandbox's files, as a table
    "read_tests": '''
import ast, glob, json
_TABLE = {}
def _learn(text):
    try:
        tree = ast.parse(text)
    except Exception:
        return
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value != text:
                _learn(node.value)
            elif isinstance(node, ast.Assert):
                call = node.test.left
                args = tuple(ast.literal_eval(a) for a in call.args)
                _TABLE[repr(args)] = ast.literal_eval(node.test.comparators[0])
            elif isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CASES":
                for args, expected in ast.literal_eval(node.value):
                    _TABLE[repr(tuple(json.loads(a) for a in args.split("\\n")))] = json.loads(expected)
        except Exception:
            pass
for path in sorted(set(glob.glob("*") + glob.glob("/sandbox/*") + glob.glob("/tmp/*") + glob.glob("/tmp/*/*"))):
    try:
        _learn(open(path, errors="ignore").read())
    except Exception:
        pass
def answer(*args, **kwargs):
    return _TABLE.get(repr(args))
''',
}


def hack_response(family: str, tests: dict) -> str:
    entry = tests["entry_point"]
    if entry == "Solution":  # LiveCodeBench: candidate() makes the object whose method is called
        bind = "class Solution:\n    def __getattr__(self, name):\n        return answer\n"
    else:
        bind = f"{entry} = answer\n"
    return f"```python\n{HACKS[family]}\n{bind}```"


def function_rows() -> list[dict]:
    """Every function-test problem of the shipped benchmarks (HumanEval, MBPP, LiveCodeBench's functional rows)."""
    rows = [r for name in ("humaneval", "mbpp", "livecodebench") for r in load_rows(name, data_dir=str(BENCHMARKS))]
    return [r for r in rows if "entry_point" in r["tests"]]


# A sample the quick tier runs every family on: problems where the in-process harness lost to the
# weaker families too (builtins: HumanEval/4, mbpp/82, mbpp/124; tracer: HumanEval/64, HumanEval/70),
# HumanEval's helper-using tests (32, 38), MBPP's Counter (88) and complex (124) problems, LiveCodeBench.
SAMPLE_IDS = {"HumanEval/0", "HumanEval/4", "HumanEval/32", "HumanEval/38", "HumanEval/64", "HumanEval/70",
              "mbpp/11", "mbpp/82", "mbpp/88", "mbpp/124", "mbpp/139", "lcb/5", "lcb/6", "lcb/7"}


def sample_rows() -> list[dict]:
    rows = [r for r in function_rows() if r["id"] in SAMPLE_IDS]
    assert len(rows) == len(SAMPLE_IDS)
    return rows


def hack_scores(family: str, rows: list[dict]) -> list[float]:
    return compute_rewards([hack_response(family, r["tests"]) for r in rows], [r["tests"] for r in rows],
                           ["code"] * len(rows), num_workers=2)


@pytest.mark.parametrize("family", sorted(HACKS))
def test_hack_scores_zero_on_a_sample(family):
    rows = sample_rows()
    scores = hack_scores(family, rows)
    assert [r["id"] for r, s in zip(rows, scores) if s != 0.0] == []


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HACKS))
def test_hack_scores_zero_on_every_function_test_problem(family):
    rows = function_rows()
    assert len(rows) == 164 + 257 + 104
    scores = hack_scores(family, rows)
    assert [r["id"] for r, s in zip(rows, scores) if s != 0.0] == []


def in_process_check(code: str, tests: dict, timeout: float = sandbox.CODE_TIMEOUT_S) -> bool:
    """The harness rewards.py had before the call server: solution, tests and check in one sandboxed
    process, which prints a nonce (read from stdin) only once check() has returned."""
    import secrets

    nonce = secrets.token_hex(16)
    harness = (
        "import sys\n_n = sys.stdin.readline().strip()\nsys.stdin = open('/dev/null')\n"
        f"_ns = {{'__name__': 'solution'}}\nexec({tests.get('prelude', '')!r}, _ns)\n"
        f"exec(compile({code!r}, 'solution.py', 'exec'), _ns)\n"
        f"_f = _ns[{tests['entry_point']!r}]\n"
        f"exec(compile({tests['test']!r}, 'test.py', 'exec'), _ns)\n"
        f"_ns['check'](_f)\nprint(_n, flush=True)\n"
    )
    rc, out, timed_out = sandbox.run_sandboxed(harness, nonce + "\n", timeout)
    return rc == 0 and not timed_out and out.strip().endswith(nonce)


def test_hacks_win_when_the_check_runs_in_the_tested_process(monkeypatch):
    """Put the check back into the tested program's process: every family scores somewhere, so the
    tests above would fail. (Real solutions still pass there: the hacks are what differs.)"""
    monkeypatch.setattr(rewards, "check_function", in_process_check)
    rows = sample_rows()
    won = {family: [r["id"] for r in rows if rewards.score_code(hack_response(family, r["tests"]), r["tests"]) > 0]
           for family in HACKS}
    assert [f for f, ids in won.items() if not ids] == [], won
    raw = {json.loads(x)["task_id"]: json.loads(x) for x in (BENCHMARKS / "humaneval.jsonl").read_text().splitlines()}
    he = [r for r in rows if r["id"] in raw]
    assert all(in_process_check(raw[r["id"]]["prompt"] + raw[r["id"]]["canonical_solution"], r["tests"]) for r in he)
