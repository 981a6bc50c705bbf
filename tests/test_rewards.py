"""rewards.py on real benchmark data, on hostile code and on adversarial strings."""

import json
import multiprocessing
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewards
from data.reward_cases import BENCHMARKS, FILES, cases
from rewards import code_reward, compute_rewards, extract_answer, math_reward, normalize
from sandboxed import sandbox

ROOT = Path(__file__).resolve().parent.parent
KNOWN = json.loads((Path(__file__).parent / "data" / "reward_known_failures.json").read_text())


# -- math: extraction -------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("so $\\boxed{\\frac{a}{b^{2}}}$ done", "\\frac{a}{b^{2}}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\fbox{7}", "7"),
    ("hence \\boxed 12$.", "12"),
    ("\\boxed {3}", "3"),
    ("work\nAnswer: 42\nmore\nAnswer: $-3$", "$-3$"),
    ("**Answer:** 17", "17"),
    ("\\boxed{unbalanced", None),
    ("no final answer here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


EQUIVALENT = {  # response: reference answer, each pair scored 1
    "\\boxed{\\dfrac{17}{50}}": "0.34", "\\boxed{1,450,000}": "1450000", "\\boxed{10080}": "10,\\!080",
    "Answer: 25": "025", "\\boxed{27}": "27.0", "\\boxed{(3,4]}": "(3,4]", "\\boxed{90}": "90^\\circ",
    "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}": "(3,\\frac{\\pi}{2})", "\\boxed{\\text{east}}": "\\text{east}",
    "\\boxed{1+\\sqrt{19}, 1-\\sqrt{19}}": "1 \\pm \\sqrt{19}",
}
NOT_EQUIVALENT = {"\\boxed{[3,4]}": "(3,4]", "\\boxed{\\frac{1}{3}}": "0.33", "\\boxed{}": "0"}


@pytest.mark.parametrize("response,answer,score", [(r, a, 1.0) for r, a in EQUIVALENT.items()]
                         + [(r, a, 0.0) for r, a in NOT_EQUIVALENT.items()])
def test_math_equivalence(response, answer, score):
    assert math_reward(response, answer) == score


# -- math: real benchmark files ------------------------------------------------------------------

@pytest.mark.parametrize("name", FILES)
def test_benchmark_answers(name):
    """Own worked solution -> correct for >= 99%; another row's (different) answer -> <= 1%."""
    cs = cases(name, 400 if name == "gsm8k_test" else None)
    n = len(cs)
    responses = [c["response"] for c in cs]
    own = compute_rewards(responses, [c["answer"] for c in cs], ["math"] * n, num_workers=2)
    other = [cs[(i + 1) % n]["answer"] for i in range(n)]
    cross = compute_rewards(responses, other, ["math"] * n, num_workers=2)
    differs = [normalize(cs[i]["answer"]) != normalize(other[i]) for i in range(n)]
    misses = {cs[i]["id"] for i in range(n) if own[i] != 1.0}
    false_pos = {cs[i]["id"] for i in range(n) if differs[i] and cross[i] == 1.0}
    assert 1 - len(misses) / n >= 0.99
    assert len(false_pos) / sum(differs) <= 0.01
    known = KNOWN[name]
    assert misses == {k["id"] for k in known if k["case"] == "own"}
    assert false_pos == {k["id"] for k in known if k["case"] == "cross"}


def test_quick_path_agrees_with_math_verify():
    """Answers decided in the caller (same canonical string, or two different integers) get the
    verdict math-verify gives: on every benchmark file's own and crossed (response, answer) pairs."""
    decided = {0.0: 0, 1.0: 0}
    for name in FILES:
        cs = cases(name, 150)
        for i, c in enumerate(cs):
            pred = rewards.last_boxed(c["response"])
            for answer in (c["answer"], cs[(i + 1) % len(cs)]["answer"]):
                quick = rewards.quick_math_reward(pred, answer) if pred is not None else None
                if quick is not None and pred is not None and len(pred) <= rewards.MAX_ANSWER_CHARS:
                    assert quick == float(rewards._verify(pred, answer)), (name, c["id"], pred, answer)
                    decided[quick] += 1
    assert decided[0.0] >= 100 and decided[1.0] >= 100, decided  # both shortcuts were exercised
    assert rewards.quick_math_reward("1/2", "0.5") is None  # equivalence is math-verify's to decide
    assert rewards.quick_math_reward("1,000", "1000") == 1.0 and rewards.quick_math_reward("-07", "7") == 0.0


def test_integer_answers_are_scored_without_workers():
    rewards.shutdown()
    responses = [f"so \\boxed{{{i % 7}}}" for i in range(200)]
    scores = compute_rewards(responses, ["3"] * 200, ["math"] * 200, num_workers=4)
    assert scores == [float(i % 7 == 3) for i in range(200)]
    assert rewards._workers == []  # no round trip to a scoring process
    # what the shortcut cannot decide still goes to math-verify in a worker
    assert compute_rewards(["\\boxed{\\frac12}", "Answer: 3"], ["0.5", "3"], ["math"] * 2) == [1.0, 1.0]
    assert len(rewards._workers) == 2


def _burn_past_the_fallback_alarm() -> None:  # a forked child whose uid has no queued signal left
    resource.setrlimit(resource.RLIMIT_SIGPENDING, (0, resource.getrlimit(resource.RLIMIT_SIGPENDING)[1]))
    rewards._thread_cpu_alarm()(0.2)
    while True:
        pass


def test_a_worker_that_cannot_arm_its_cpu_timer_still_scores_and_is_still_bounded():
    # A POSIX timer reserves one of the signals its uid may queue (RLIMIT_SIGPENDING): a sandbox of the scorer's uid
    # that holds them all (without root) made every new worker die at start, each correct response a silent 0.
    # With none left (the limit 0 here, inherited by the workers), the workers bound their CPU another way and score
    rewards.shutdown()
    soft, hard = resource.getrlimit(resource.RLIMIT_SIGPENDING)
    resource.setrlimit(resource.RLIMIT_SIGPENDING, (0, hard))
    stats = {}
    try:
        scores = compute_rewards(["\\boxed{\\frac12}", "\\boxed{\\frac13}", fenced("a, b = map(int, input().split())\n"
                                  "print(a + b)")], ["0.5", "0.5", ADD_TESTS], ["math", "math", "code"],
                                 num_workers=2, stats=stats)
    finally:
        resource.setrlimit(resource.RLIMIT_SIGPENDING, (soft, hard))
        rewards.shutdown()
    assert scores == [1.0, 0.0, 1.0] and stats == {"timeouts": 0, "errors": 0}
    # the fallback still ends a worker whose thread runs past its CPU bound (the process's profiling timer)
    child = multiprocessing.get_context("fork").Process(target=_burn_past_the_fallback_alarm)
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGPROF


# -- math: pathological and fuzzed input -----------------------------------------------------------

PATHOLOGICAL = [
    "\\boxed{10^{10^{10^{10}}}}",
    "\\boxed{" + "{" * 100_000 + "1" + "}" * 100_000 + "}",
    "x" * 1_000_000 + "\\boxed{2}",
    "\\boxed{" + "9" * 5000 + "!}",
    "\\boxed{\\int_0^{\\infty} e^{-x^{x^{x}}} dx}",
]


def test_pathological_responses_never_block_the_batch():
    responses = PATHOLOGICAL + ["\\boxed{2}", "Answer: 3"]
    stats = {}
    t0 = time.time()
    scores = compute_rewards(responses, ["2"] * len(PATHOLOGICAL) + ["2", "3"], ["math"] * len(responses),
                             num_workers=2, stats=stats)
    elapsed = time.time() - t0
    assert scores[-2:] == [1.0, 1.0]  # the well-formed ones are still scored
    assert scores[0] == 0.0 and scores[1] == 0.0 and scores[3] == 0.0
    assert scores[2] == 1.0  # a long response with a valid final answer is fine
    # every item is bounded by its hard limit; with 2 workers the batch ends well inside
    assert elapsed < len(responses) * (2 * rewards.MATH_TIMEOUT_S + 1) / 2 + 10, stats


def test_hard_timeout_kills_a_stuck_worker(clean_machine):
    loop = "```python\nwhile True:\n    pass\n```"
    tests = {"stdio": [{"input": "", "output": "x"}]}
    stats = {}
    t0 = time.time()
    scores = compute_rewards([loop, loop, "\\boxed{2}"], [tests, tests, "2"], ["code", "code", "math"],
                             num_workers=2, stats=stats, timeout=1.5)
    assert scores == [0.0, 0.0, 1.0] and stats["timeouts"] == 2
    assert time.time() - t0 < 10  # killed at 1.5 s, not at the sandbox's own 10 s limit
    assert compute_rewards(["\\boxed{2}"] * 2, ["2"] * 2, ["math"] * 2, num_workers=2) == [1.0, 1.0]


adversarial = st.one_of(
    st.text(max_size=300),
    st.text(alphabet="\\{}$^_boxedfracAnswer:0123456789.,()[] \n", max_size=300),
    st.builds(lambda a, b: f"\\boxed{{{a}}}{b}", st.text(max_size=80), st.text(max_size=40)),
    st.builds(lambda a: f"Answer: {a}", st.text(max_size=120)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=adversarial, answer=st.one_of(st.text(max_size=40), st.sampled_from(["2", "\\frac{1}{2}", "(3,4]"])))
def test_math_reward_fuzz(response, answer):
    t0 = time.time()
    score = math_reward(response, answer)
    assert score in (0.0, 1.0)
    assert time.time() - t0 < 2 * rewards.MATH_TIMEOUT_S + 1


# -- code: benchmarks ------------------------------------------------------------------------------

def humaneval():
    return [json.loads(line) for line in (BENCHMARKS / "humaneval.jsonl").read_text().splitlines()]


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


def test_humaneval_canonical_solutions_pass_and_wrong_bodies_fail():
    rows = humaneval()
    # The prelude (the prompt, as data/prepare.py ships it) gives the tests their helpers (`poly`,
    # `encode_cyclic`): the check never takes them from the response, which could redefine them.
    tests = [{"test": r["test"], "entry_point": r["entry_point"], "prelude": r["prompt"]} for r in rows]
    good = compute_rewards([fenced(r["prompt"] + r["canonical_solution"]) for r in rows], tests,
                           ["code"] * len(rows), num_workers=2)
    failed = [r["task_id"] for r, s in zip(rows, good) if s != 1.0]
    assert not failed
    some = rows[:20]
    empty = compute_rewards([fenced(r["prompt"] + "    pass\n") for r in some], tests[:20], ["code"] * 20, 2)
    none = compute_rewards(["I cannot write code."] * 20, tests[:20], ["code"] * 20, 2)
    assert sum(empty) == 0 and sum(none) == 0


HELPER_PROBLEMS = ("HumanEval/10", "HumanEval/32", "HumanEval/38", "HumanEval/50")  # use helpers from the prompt


def entry_point_only(row: dict) -> str:
    """A correct answer as models write it: just the entry-point function, no helpers, no imports."""
    start = row["prompt"].index(f"def {row['entry_point']}(")
    return fenced(row["prompt"][start:] + row["canonical_solution"])


def test_humaneval_entry_point_only_answers_pass_and_stubs_fail():
    from data.prepare import load_rows

    raw = {r["task_id"]: r for r in humaneval()}
    rows = load_rows("humaneval", data_dir=str(BENCHMARKS))
    tests = [r["tests"] for r in rows]
    good = compute_rewards([entry_point_only(raw[r["id"]]) for r in rows], tests, ["code"] * len(rows), 2)
    assert [r["id"] for r, s in zip(rows, good) if s != 1.0] == []
    assert all(g == 1.0 for r, g in zip(rows, good) if r["id"] in HELPER_PROBLEMS)
    # the prelude's documented stub must not pass for the model: `pass` bodies, the prompt alone, no code
    stub = compute_rewards([fenced(raw[r["id"]]["prompt"] + "    pass\n") for r in rows], tests, ["code"] * 164, 2)
    echo = compute_rewards([fenced(raw[r["id"]]["prompt"]) for r in rows], tests, ["code"] * 164, 2)
    assert sum(stub) == 0 and sum(echo) == 0


ADD_TESTS = {"stdio": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}]}


def test_stdio_tests_pass_fraction_and_whitespace():
    assert code_reward(fenced("a, b = map(int, input().split())\nprint(a + b, ' ')"), ADD_TESTS) == 1.0
    assert code_reward(fenced("print(3)"), ADD_TESTS) == 0.0  # one case's expected output: not every test
    assert code_reward(fenced("print(3)"), ADD_TESTS, partial=True) == 0.5  # the fraction, on request
    assert code_reward("```python\nprint(\n```", ADD_TESTS) == 0.0  # syntax error


# -- code: hostile programs -------------------------------------------------------------------------

try:
    FULL_ISOLATION = sandbox.sandbox_mode() == "bwrap" or (os.geteuid() == 0 and sandbox._python_readable_by_others())
except sandbox.SandboxUnavailable:
    FULL_ISOLATION = False
needs_isolation = pytest.mark.skipif(not FULL_ISOLATION, reason="no bubblewrap and cannot drop privileges here")
ECHO_TEST = {"test": "def check(candidate):\n    assert candidate() == 1\n", "entry_point": "f"}


def hostile(code: str, tests=None, timeout: float = 3.0) -> tuple[float, float]:
    t0 = time.time()
    score = code_reward(fenced(code), tests or {"stdio": [{"input": "", "output": "ok"}]}, timeout=timeout)
    return score, time.time() - t0


def test_infinite_loop(clean_machine):
    score, secs = hostile("while True:\n    pass")
    assert score == 0.0 and secs < 3.0 + 5


@needs_isolation
def test_fork_bomb(clean_machine):
    score, secs = hostile("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert score == 0.0 and secs < 3.0 + 5


def test_ten_gigabyte_allocation(clean_machine):
    score, secs = hostile("x = bytearray(10 * 1024 ** 3)\nprint('ok')")
    assert score == 0.0 and secs < 3.0 + 5


@needs_isolation
def test_write_outside_temp_dir(clean_machine, tmp_path):
    targets = [tmp_path / "pwned.txt", ROOT / "pwned.txt", Path.home() / "pwned.txt"]
    code = "".join(f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept Exception:\n    pass\n" for t in targets)
    hostile(code + "print('ok')")
    assert not any(t.exists() for t in targets)


@needs_isolation
def test_delete_file_outside_temp_dir(clean_machine, tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    score, _ = hostile(f"import os\nos.remove({str(keep)!r})\nprint('ok')")
    assert keep.read_text() == "precious" and score == 0.0


@needs_isolation
def test_environment_secret_is_not_readable(clean_machine, monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "s3cr3t-value")
    code = ("import os\nv = os.environ.get('GRPO_TEST_SECRET', '')\n"
            f"try:\n    v += open('/proc/{os.getpid()}/environ').read()\nexcept Exception:\n    pass\n"
            "print('ok' if 's3cr3t-value' in v else 'no')")
    # scored in this process, whose environment holds the secret
    assert rewards.score_code(fenced(code), {"stdio": [{"input": "", "output": "ok"}]}, timeout=3.0) == 0.0


@needs_isolation
def test_no_network(clean_machine):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(6)
    port = server.getsockname()[1]
    got = []

    def accept():
        try:
            got.append(server.accept())
        except OSError:  # timed out or closed: nobody connected
            pass

    threading.Thread(target=accept, daemon=True).start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('ok')"
    score, _ = hostile(code)
    time.sleep(0.5)
    server.close()
    assert score == 0.0 and not got


@needs_isolation
def test_cannot_kill_the_parent(clean_machine):
    code = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}):\n    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n    except Exception:\n        pass\nprint('ok')")
    hostile(code)
    assert os.getpid() > 0  # still alive to assert anything at all


FLOOD = "while True:\n    print('x' * 10000)"


@pytest.mark.parametrize("tests", [{"stdio": [{"input": "", "output": "ok"}]}, ECHO_TEST], ids=["stdio", "function"])
def test_output_flood_is_cut_off(clean_machine, tests):
    """Endless output scores 0 quickly, and the scorer's own memory stays bounded."""
    # the peak RSS of this process image (VmHWM): getrusage's ru_maxrss keeps the launching process's
    # peak across exec, which is pytest's own after a long session
    code = ("import re, sys, time\nsys.path.insert(0, sys.argv[1])\nfrom rewards import score_code\n"
            f"t0 = time.time()\ns = score_code({fenced(FLOOD)!r}, {tests!r})\n"  # the scorer is this process
            "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
            "print(s, time.time() - t0, hwm)")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120)
    score, secs, rss_kib = res.stdout.split()
    assert float(score) == 0.0 and float(secs) < 20 and int(rss_kib) < 1024 * 1024


def test_output_up_to_the_cap_is_read_whole(clean_machine):
    size = sandbox.CODE_MAX_OUTPUT_BYTES // 2
    tests = {"stdio": [{"input": "", "output": "y" * size}]}
    assert code_reward(fenced(f"import sys\nsys.stdout.write('y' * {size})"), tests) == 1.0
    over = {"stdio": [{"input": "", "output": "y" * (2 * size + 10)}]}  # right answer, but past the cap
    assert code_reward(fenced(f"import sys\nsys.stdout.write('y' * {2 * size + 10})"), over) == 0.0


def test_exit_before_tests_does_not_pass(clean_machine):
    assert hostile("import sys\nsys.exit(0)\ndef f():\n    return 1", ECHO_TEST)[0] == 0.0
    assert hostile("import os\nprint('PASS')\nos._exit(0)", ECHO_TEST)[0] == 0.0
    reread = "import os\nos.lseek(0, 0, 0)\nprint(os.read(0, 100).decode().strip(), flush=True)\nos._exit(0)"
    assert hostile(reread, ECHO_TEST)[0] == 0.0  # stdin holds nothing, and what is printed does not count
    assert hostile("def f():\n    return 1", ECHO_TEST)[0] == 1.0  # and a real solution does pass


# -- fail closed without bubblewrap ----------------------------------------------------------------

def score_code_with(env: dict) -> subprocess.CompletedProcess:
    code = ("import sys\nsys.path.insert(0, sys.argv[1])\nfrom rewards import compute_rewards\n"
            f"print(compute_rewards([{fenced('print(3)')!r}], [{ADD_TESTS!r}], ['code'], 1, code_partial=True))")
    return subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_code_rewards_fail_closed_without_bubblewrap(tmp_path):
    no_bwrap = {"PATH": str(tmp_path)}  # a PATH on which bwrap (and unshare) cannot be found
    res = score_code_with(no_bwrap)
    assert res.returncode != 0 and "need bubblewrap" in res.stderr and "REWARDS_SANDBOX" in res.stderr
    assert res.stdout == ""
    weaker = score_code_with({**no_bwrap, "REWARDS_SANDBOX": "rlimits"})  # an explicit opt-in runs, and says so
    assert weaker.returncode == 0 and weaker.stdout.strip() == "[0.5]", weaker.stderr[-2000:]
    assert "REWARDS_SANDBOX=rlimits" in weaker.stderr
    bad = score_code_with({"REWARDS_SANDBOX": "none"})
    assert bad.returncode != 0 and "REWARDS_SANDBOX='none'" in bad.stderr


def test_math_rewards_need_no_sandbox(tmp_path):
    code = "import sys\nsys.path.insert(0, sys.argv[1])\nfrom rewards import compute_rewards\n" \
           "print(compute_rewards(['\\\\boxed{2}'], ['2'], ['math'], 1))"
    res = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PATH": str(tmp_path)})
    assert res.returncode == 0 and res.stdout.strip() == "[1.0]", res.stderr[-2000:]


# -- code: function tests checked outside the sandbox (the hack families: test_reward_hacks.py) --

PLAIN = [None, True, 0, -2**200, 1.5, -0.0, float("inf"), float("-inf"), 1 + 2j, "é\ud800", b"\x00\xff",
         [1, (2, 3)], (1, [2]), {1, 2}, frozenset({(1, 2)}), {(1, 2): [3.0], "k": {frozenset(): b""}}, ((),)]


def test_plain_data_crosses_with_its_types():
    for value in PLAIN:
        back = sandbox.decode_plain(json.loads(json.dumps(sandbox.encode_plain(value))))
        assert back == value and repr(back) == repr(value), value
    nan = sandbox.decode_plain(sandbox.encode_plain(float("nan")))
    assert type(nan) is float and nan != nan
    assert sandbox.decode_plain(sandbox.encode_plain(True)) is True
    assert type(sandbox.decode_plain(sandbox.encode_plain(1))) is int  # not a bool


def test_subclasses_cross_as_their_builtin_value_and_anything_else_not_at_all():
    from collections import Counter, namedtuple

    class AnyInt(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    assert type(sandbox.decode_plain(sandbox.encode_plain(Counter("aab")))) is dict
    assert sandbox.decode_plain(sandbox.encode_plain(namedtuple("P", "x y")(1, 2))) == (1, 2)
    back = sandbox.decode_plain(sandbox.encode_plain(AnyInt(5)))
    assert type(back) is int and back == 5 and back != 6  # the override stayed behind
    for value in (object(), iter([1]), [1, object()], range(3), lambda: 1, type, rewards):
        with pytest.raises(ValueError):
            sandbox.encode_plain(value)
    deep = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError):
        sandbox.encode_plain(deep)


@pytest.mark.parametrize("message", [1, 1.5, "raw", {"i": "1"}, ["i", 1], ["x", "1"], ["l", "ab"], ["d", [[1]]],
                                     ["s", [["l", []]]], ["c", ["1", 2]], ["f", "nope"], ["t", [["i", "1"]], "extra"]])
def test_decode_rejects_what_no_encoding_produces(message):
    """Raw JSON numbers, objects, unknown tags, malformed bodies, unhashable set members: refused."""
    with pytest.raises((ValueError, TypeError)):
        sandbox.decode_plain(message)


def function_tests(test: str, entry: str = "f") -> dict:
    return {"test": test, "entry_point": entry}


CHECK = "def check(candidate):\n    "  # the opening of every test below


@pytest.mark.parametrize("solution,test,score", [
    # a tuple is not the list a HumanEval test expects, and the other way round
    ("def f(x):\n    return (x, x)", CHECK + "assert candidate(1) == [1, 1]", 0.0),
    ("def f(x):\n    return [x, x]", CHECK + "assert candidate(1) == [1, 1]", 1.0),
    ("def f(x):\n    return {x: (x,)}", CHECK + "assert candidate(2) == {2: (2,)}", 1.0),
    # a tolerance the test states
    ("def f(x):\n    return x / 3", CHECK + "assert abs(candidate(1) - 0.3333333) < 1e-6", 1.0),
    ("def f(x):\n    return float('inf')", "import math\n" + CHECK + "assert math.isinf(candidate(1))", 1.0),
    # an exception the test expects, and one it does not
    ("def f(x):\n    raise ValueError('no')",
     CHECK + "try:\n        candidate(-1)\n    except ValueError as e:\n        assert str(e) == 'no'\n"
     "    else:\n        assert False", 1.0),
    ("def f(x):\n    raise TypeError('no')",
     CHECK + "try:\n        candidate(-1)\n    except ValueError:\n        pass\n    else:\n        assert False", 0.0),
    # a StopIteration does not end the check's own iteration early
    ("def f(x):\n    raise StopIteration", CHECK + "assert all(map(candidate, [1, 2]))", 0.0),
    # keyword arguments, sets, bytes
    ("def f(a, *, b):\n    return sorted(a | b)", CHECK + "assert candidate({1}, b={2}) == [1, 2]", 1.0),
    ("def f(x):\n    return x[::-1]", CHECK + "assert candidate(b'ab') == b'ba'", 1.0),
    # results that are no plain data fail, even where the test would accept them
    ("def f(x):\n    return iter([x])", CHECK + "assert list(candidate(1)) == [1]", 0.0),
    ("def f(x):\n    return f", CHECK + "assert candidate(1) is not None", 0.0),
    # the tested code's SystemExit or a silent death fail, even inside the test's own try/except
    ("def f(x):\n    raise SystemExit(0)",
     CHECK + "try:\n        candidate(1)\n    except BaseException:\n        pass", 0.0),
    ("import os\ndef f(x):\n    os._exit(0)", CHECK + "try:\n        candidate(1)\n    except:\n        pass", 0.0),
])
def test_function_test_semantics(solution, test, score):
    assert code_reward(fenced(solution), function_tests(test)) == score


def test_class_entry_point_objects_live_in_the_sandbox():
    """LiveCodeBench's Solution(): methods run in the sandbox; the object itself has no value here."""
    tests = function_tests("def check(candidate):\n    s = candidate()\n    assert s.add(1, 2) == 3\n"
                           "    assert s.add(0, 0) == 0\n    assert s != 3 and s is not None", "Solution")
    good = ("class Solution:\n    def add(self, a, b):\n        return a + b\n"
            "    def __eq__(self, other):\n        return True")
    assert code_reward(fenced(good), tests) == 1.0
    assert code_reward(fenced(good.replace("a + b", "a - b")), tests) == 0.0
    leaky = function_tests("def check(candidate):\n    assert candidate().me() == 1", "Solution")
    assert code_reward(fenced("class Solution:\n    def me(self):\n        return self"), leaky) == 0.0


def test_tests_use_the_preludes_helpers_not_the_solutions():
    """HumanEval/32's check evaluates `poly` on the answer: a solution that redefines poly gains nothing."""
    from data.prepare import load_rows

    row = next(r for r in load_rows("humaneval", data_dir=str(BENCHMARKS)) if r["id"] == "HumanEval/32")
    cheat = "def poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 0.0\n"
    assert code_reward(fenced(cheat), row["tests"]) == 0.0


@needs_isolation
def test_checking_process_is_out_of_reach(clean_machine):
    """The sandbox sees no process but its own few (no /proc at all, no checker, no pytest) and cannot signal the
    scorer: its pid and the server's parent's are not in the sandbox's PID namespace."""
    if sandbox.sandbox_mode() != "bwrap":
        pytest.skip("only bubblewrap gives the sandbox a PID namespace and hides /proc")
    probe = ("import os, signal\ndef f():\n    alive = []\n    for pid in range(1, 4096):\n        try:\n"
             "            os.kill(pid, 0)\n            alive.append(pid)\n        except OSError:\n            pass\n"
             f"    for pid in (os.getppid(), {os.getpid()}):\n        try:\n            os.kill(pid, signal.SIGKILL)\n"
             "        except OSError:\n            pass\n    return [os.path.exists('/proc/self'), alive]\n")
    test = "def check(candidate):\n    proc, alive = candidate()\n    assert not proc and 0 < len(alive) <= 2, alive"
    assert code_reward(fenced(probe), function_tests(test)) == 1.0


@pytest.mark.slow  # a worker killed and replaced, and the control's 5 s deadline
def test_the_checks_own_cpu_on_a_returned_value_is_bounded(clean_machine, monkeypatch):
    """Ints that all hash alike, which the benchmark's check puts in a set: seconds of the scorer's CPU (about 11 s
    here), outside every sandbox's limit. The worker ends at CODE_CHECK_CPU_S (an error: the worker died), well
    before the item's wall deadline; the control, without the bound, runs on to its deadline."""
    program = fenced("def f():\n    return [k * (2 ** 61 - 1) for k in range(1, 50000)]\n")
    tests = function_tests("def check(candidate):\n    assert len(set(candidate())) == 3\n")
    stats = {}
    assert compute_rewards([program], [tests], ["code"], 1, stats=stats) == [0.0]
    assert stats == {"timeouts": 0, "errors": 1}
    monkeypatch.setattr(rewards, "CODE_CHECK_CPU_S", None)
    assert compute_rewards([program], [tests], ["code"], 1, stats=stats, timeout=5) == [0.0]
    assert stats == {"timeouts": 1, "errors": 0}
    assert compute_rewards([fenced("def f():\n    return [1, 2, 3]\n")], [tests], ["code"], 1) == [1.0]


# -- code: stdio tests, all cases of a response in one sandbox start -----------------------------------

def test_stdio_cases_share_one_sandbox_start(monkeypatch):
    starts = []
    real = sandbox._sandbox
    monkeypatch.setattr(sandbox, "_sandbox", lambda *a, **k: starts.append(1) or real(*a, **k))
    tests = {"stdio": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(5)]}
    assert rewards.score_code(fenced("print(2 * int(input()))"), tests) == 1.0  # in this process
    assert len(starts) == 1


@needs_isolation
def test_each_case_reads_only_its_own_input(clean_machine):
    """No case finds another's input: not on stdin, not in the sandbox's files, not through /proc."""
    spy = ("import glob, os, sys\nown = sys.stdin.read()\nfound = set()\n"
           "for path in glob.glob('/sandbox/*') + glob.glob('/sandbox/.*/*') + glob.glob('/tmp/*')\\\n"
           "        + glob.glob('/proc/[0-9]*/fd/*'):\n"
           "    try:\n        found.add(open(path, 'rb', buffering=0).read(100).decode()\\\n"
           "                  if os.stat(path).st_size else '')\n    except Exception:\n        pass\n"
           "print(own, sorted(s for s in found if s.startswith('secret-') and s != own))")
    tests = {"stdio": [{"input": f"secret-{i}", "output": f"secret-{i} []"} for i in range(3)]}
    assert code_reward(fenced(spy), tests) == 1.0


def test_each_case_has_its_own_time_limit_and_output_cap(clean_machine):
    program = ("import sys\ncase = sys.stdin.read().strip()\nif case == 'loop':\n    while True:\n        pass\n"
               "if case == 'flood':\n    while True:\n        print('x' * 10000)\nprint(case)")
    tests = {"stdio": [{"input": c, "output": c} for c in ("loop", "a", "flood", "b")]}
    t0 = time.time()
    assert code_reward(fenced(program), tests, partial=True, timeout=2.0) == 0.5
    assert time.time() - t0 < 2.0 + 6


@needs_isolation
def test_what_a_case_leaves_running_is_gone_before_the_next(clean_machine):
    program = ("import os, sys, time\nif sys.stdin.read().strip() == 'first':\n    if os.fork() == 0:\n"
               "        os.setsid()\n        os.dup2(os.open('/dev/null', os.O_WRONLY), 1)\n"
               "        time.sleep(0.5)\n        open('/sandbox/late', 'w').write('x')\n"
               "        os._exit(0)\n    print('first')\nelse:\n    time.sleep(1.0)\n"
               "    print('clean' if not os.path.exists('/sandbox/late') else 'leftover')")
    tests = {"stdio": [{"input": "first", "output": "first"}, {"input": "second", "output": "clean"}]}
    assert code_reward(fenced(program), tests) == 1.0
