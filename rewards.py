"""Rule-based verifiable rewards, shared by train_grpo.py and evaluate.py.

    math_reward(response, answer) -> 1.0 | 0.0
        final answer = last \\boxed{...} (or \\fbox, or `\\boxed x`), else the last `Answer: ...`
        line (DAPO-17k); compared by exact string first, then by mathematical equivalence
        with math-verify (fractions/decimals, \\sqrt, intervals, tuples, sets, units, %, ...).
    code_reward(response, tests) -> 1.0 | 0.0 (all tests pass; the pass fraction with partial=True)
        last fenced Python block, run against {"test", "entry_point"} (HumanEval/MBPP) or
        {"stdio": [{"input", "output"}, ...]} (LiveCodeBench/Codeforces) in a sandbox. Function
        tests: the solution runs alone in the sandbox behind a call server, the tests' check runs
        here and gets plain data back (check_function). Stdio: every case of a response in one
        sandbox start, each its own forked process; outputs compared here (run_cases).
    compute_rewards(responses, references, kinds, num_workers) -> list[float]
        a whole rollout batch in persistent worker processes, order kept; every item bounded
        by a hard timeout (the worker is killed and replaced), so nothing blocks the batch.

math-verify enforces its own timeouts with signal.alarm, which only works in a process's main
thread (elsewhere it silently scores 0): scoring therefore runs in the workers' main thread.

The sandbox that runs model-written code is sandboxed/sandbox.py (docs/rewards.md).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from sandboxed import sandbox
from sandboxed.sandbox import CODE_TIMEOUT_S, SandboxUnavailable, run_cases, sandbox_mode  # noqa: F401

log = logging.getLogger("rewards")
# Bumped whenever the same response could score differently: evaluate.py keys its caches by it, so that no
# table mixes scores of two versions. 2: code counts only a full pass. 3: as root, a sandbox sees the
# standard library only (no package the host's interpreter happens to have), and one past its memory fails. 4: a
# sandboxed program has no /proc, pipe, socket or memfd (docs/rewards.md), and the check's CPU is bounded.
SCORING_VERSION = 4
MATH_TIMEOUT_S = 5  # seconds (an int: math-verify hands it to signal.alarm)
# The scorer's own CPU on one code item (the benchmark's check, decoding what the sandbox returns, in the worker's
# main thread), outside every sandbox's limits: past it the scoring worker is killed (_thread_cpu_alarm) and the
# item scores 0. The heaviest check of the 421 HumanEval and MBPP reference solutions took 8 ms (docs/rewards.md);
# one crafted return value (ints that all hash alike, put in a set by the check) took 12.5 s.
CODE_CHECK_CPU_S = 2
MAX_ANSWER_CHARS = 1000  # longer "answers" are not worth symbolic verification


# -----------------------------------------------------------------------------
# Math


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...} (nested braces), or of `\\boxed x`."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    cmd = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
    i = start + len(cmd)
    if text.startswith(" ", i) and not text[i:].lstrip().startswith("{"):  # "\boxed 5"
        m = re.match(r"\s+([^\s$]+)", text[i:])
        return m.group(1) if m else None
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced


_ANSWER_LINE = re.compile(r"(?im)^[ \t*#]*answer[ \t*]*:[ \t*]*(.+?)[ \t]*$")


def extract_answer(text: str) -> str | None:
    """The final answer: the last \\boxed{} if any, else the last `Answer: ...` line (DAPO)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text)
    return lines[-1] if lines else None


def normalize(ans: str) -> str:
    """Cheap canonical form for the exact-match fast path (math-verify handles the rest)."""
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\[,!;: ]", "", s)  # thin spaces: 10,\!080
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+", s):
        s = str(int(s))  # 025 -> 25
    elif re.fullmatch(r"-?\d+\.\d*0+", s):
        s = s.rstrip("0").rstrip(".")  # 27.0 -> 27
    return s


def _verify(pred: str, answer: str) -> bool:
    from math_verify import parse, verify

    gold = parse(f"${normalize(answer)}$", parsing_timeout=MATH_TIMEOUT_S)
    guess = parse(f"${normalize(pred)}$", parsing_timeout=MATH_TIMEOUT_S)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=MATH_TIMEOUT_S))


_INTEGER = re.compile(r"-?\d+")


def quick_math_reward(pred: str | None, answer: str) -> float | None:
    """The cases decided without math-verify: no answer, the same canonical string, or two
    different integers; None for the rest."""
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return 0.0
    p, a = normalize(pred), normalize(answer)
    if p == a:
        return 1.0
    if _INTEGER.fullmatch(p) and _INTEGER.fullmatch(a):
        return 0.0  # normalize() canonicalises integers (025 -> 25, 1,000 -> 1000)
    return None


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the reference, else 0.0. Never raises."""
    try:
        pred = extract_answer(response)
        quick = quick_math_reward(pred, answer)
        return quick if quick is not None else float(_verify(pred, answer))
    except Exception:
        return 0.0


# -----------------------------------------------------------------------------
# Code

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)


def extract_code(response: str) -> str | None:
    """The last fenced code block (```python ... ```), else None."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


def _normalize_output(s: str) -> str:
    return "\n".join(line.rstrip() for line in s.strip().splitlines())


def check_function(code: str, tests: dict, timeout: float = CODE_TIMEOUT_S) -> bool:
    """Whether the solution `code` passes `tests` ({"test", "entry_point"[, "prelude"]}): the test's
    check(candidate) runs here against a stub of the entry point; the solution runs in the sandbox,
    behind its call server (sandbox.call_server), which returns plain data only."""
    prelude, entry = tests.get("prelude", ""), tests["entry_point"]
    with sandbox.call_server(code, prelude, entry, timeout) as calls:
        try:
            if not calls.ready():
                return False
            # The prelude (the benchmark's own: imports, helpers such as HumanEval's `poly`) runs
            # on both sides: the tests use its helpers from here, never the solution's versions.
            ns = {"__name__": "check"}
            exec(prelude, ns)
            candidate = ns[entry] = lambda *args, **kwargs: calls.call(None, args, kwargs)
            exec(compile(tests["test"], "test.py", "exec"), ns)
            ns["check"](candidate)
        except (Exception, SystemExit, sandbox.Disqualified):
            return False
        return not calls.broken


def score_code(response: str, tests: dict | str, partial: bool = False, timeout: float = CODE_TIMEOUT_S) -> float:
    """1.0 if the response's program passes every test, else 0.0; with partial=True, the fraction of
    stdio cases passed (a function test's check is one verdict). In this process, with no deadline
    past the sandbox's own: what a scoring worker runs (use code_reward or compute_rewards). Never
    raises, but SandboxUnavailable."""
    try:
        if isinstance(tests, str):
            tests = json.loads(tests)
        code = extract_code(response)
        if code is None:
            return 0.0
        if "stdio" in tests:
            cases = tests["stdio"]
            with contextlib.closing(run_cases(code, [case["input"] for case in cases], timeout)) as runs:
                passed = sum(rc == 0 and not timed_out and _normalize_output(out) == _normalize_output(case["output"])
                             for case, (rc, out, timed_out) in zip(cases, runs))
            score = passed / len(cases) if cases else 0.0
        else:
            score = float(check_function(code, tests, timeout))
        return float(score) if partial else float(score == 1.0)
    except SandboxUnavailable:
        raise  # a machine without the sandbox must not silently score every program 0
    except Exception:
        return 0.0


def code_reward(response: str, tests: dict | str, partial: bool = False, timeout: float = CODE_TIMEOUT_S) -> float:
    """score_code in a scoring worker, under compute_rewards' hard deadline: 1.0 if every test
    passes (the fraction of stdio cases with partial=True), 0.0 past the deadline."""
    return compute_rewards([response], [tests], ["code"], 1, code_partial=partial, code_timeout=timeout)[0]


# -----------------------------------------------------------------------------
# Batch scoring in persistent worker processes with a hard per-item timeout


def score_math(response: str, answer, partial: bool, timeout: float) -> float:
    return math_reward(response, str(answer))  # all or nothing, within MATH_TIMEOUT_S whatever `timeout` says


CODE_INSTRUCTION = "Write your solution as a complete program or function in one ```python code block."

# The reward kinds, each in one entry: the key of a dataset row its responses are scored against ("reference"),
# its scorer (response, reference, partial, timeout) -> a score in [0, 1], run in a scoring worker under the
# batch's hard deadline, and the instruction its prompts end with under every template ("instruction"; None: the
# template's own, as math's). data/prepare.py checks a kind's rows by it, data/templates.py renders their
# prompts, compute_rewards scores them: a new kind is an entry here and nothing else (tests/test_fork_a_kind.py).
KINDS = {
    "math": {"reference": "answer", "score": score_math, "instruction": None},
    "code": {"reference": "tests", "score": score_code, "instruction": CODE_INSTRUCTION},
}
REFERENCE_KEY = {kind: spec["reference"] for kind, spec in KINDS.items()}


def score_one(response: str, reference, kind: str, partial: bool = False, timeout: float = CODE_TIMEOUT_S) -> float:
    if kind not in KINDS:
        raise ValueError(f"unknown reward kind {kind!r} (expected one of {', '.join(KINDS)})")
    return KINDS[kind]["score"](response, reference, partial, timeout)


class _ItimerSpec(ctypes.Structure):  # struct itimerspec: the interval, then the first expiry (s, ns)
    _fields_ = [("interval_s", ctypes.c_long), ("interval_ns", ctypes.c_long), ("value_s", ctypes.c_long),
                ("value_ns", ctypes.c_long)]


def _thread_cpu_alarm() -> Callable[[float], None]:
    """arm(seconds): SIGXCPU, which ends this process, once this thread has used `seconds` more CPU (0 disarms).
    The thread's own CPU clock (a POSIX timer on CLOCK_THREAD_CPUTIME_ID), not the process's: the sandbox
    watchdog's thread is not the check's work; and unlike RLIMIT_CPU it is not inherited by the sandboxes this
    process starts. A POSIX timer reserves one of the signals its uid may have queued (RLIMIT_SIGPENDING), which
    a process of the same uid can spend (a sandbox that holds timers, where the scorer runs without root): then
    the process's profiling timer bounds the process's CPU instead (SIGPROF ends it as SIGXCPU would), which
    reserves none; the watchdog's few milliseconds count with the check's."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "timer_create"):  # in librt before glibc 2.34
        libc = ctypes.CDLL("librt.so.1", use_errno=True)
    event = (ctypes.c_int * 16)()  # struct sigevent: the value (8 bytes), signo, notify (SIGEV_SIGNAL: 0), ...
    event[2] = signal.SIGXCPU
    timer = ctypes.c_void_p()
    if libc.timer_create(3, event, ctypes.byref(timer)) != 0:  # CLOCK_THREAD_CPUTIME_ID
        if ctypes.get_errno() != errno.EAGAIN:
            raise OSError(ctypes.get_errno(), "timer_create")
        return lambda seconds: signal.setitimer(signal.ITIMER_PROF, seconds)

    def arm(seconds: float) -> None:
        spec = _ItimerSpec(0, 0, int(seconds), int(seconds % 1 * 1e9))
        if libc.timer_settime(timer, 0, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timer_settime")

    return arm


def _worker_main(tmp_root: str, root: str) -> None:
    """A scoring worker: JSON lines in on stdin, JSON lines out on stdout, in its main thread."""
    sandbox.as_worker(tmp_root, root)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers end
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints (e.g. from libraries) must not corrupt the channel
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker past its CPU bound dies without a core file
    cpu_alarm = _thread_cpu_alarm()
    for line in sys.stdin:
        job = json.loads(line)
        cpu_alarm(job["cpu"] or 0)
        try:
            score = score_one(job["response"], job["reference"], job["kind"], job["partial"], job["timeout"])
            err = None
        except Exception as e:  # noqa: BLE001 - reported as an error count, scored 0
            score, err = 0.0, repr(e)[:200]
        cpu_alarm(0)
        out.write(json.dumps({"i": job["i"], "score": score, "error": err}) + "\n")
        out.flush()


# Workers are plain subprocesses (`python rewards.py --worker DIR`), so they import neither the
# caller's main module nor torch. Under the weaker sandbox modes each keeps its sandboxes' host
# directories in DIR (made on first use), which the parent removes if it has to kill the worker;
# under bubblewrap nothing is written on the host.
_workers: list[tuple[subprocess.Popen, str]] = []
_pool_lock = threading.Lock()  # one batch at a time goes through the workers (threads of a caller queue)


def _spawn() -> tuple[subprocess.Popen, str]:
    sandbox.sweep_leftovers()  # a worker is started or replaced: the one it replaces may have left its sandbox's
    tmp_root = os.path.join(tempfile.gettempdir(), f"rewards-pool-{secrets.token_hex(8)}")
    root = sandbox.shared_root()  # the parent's, made by sandbox_mode's probe before any worker
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", tmp_root, root or ""],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    return proc, tmp_root


def _replace(slot: int) -> tuple[subprocess.Popen, str]:
    proc, tmp_root = _workers[slot]
    proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        f.close()
    shutil.rmtree(tmp_root, ignore_errors=True)
    _workers[slot] = _spawn()
    return _workers[slot]


@atexit.register
def shutdown() -> None:
    """End the worker processes."""
    for slot in range(len(_workers)):
        proc, tmp_root = _workers[slot]
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp_root, ignore_errors=True)
    _workers.clear()


def reference(row: dict):
    """What a dataset row's responses are scored against: its kind's reference key (KINDS)."""
    return row[REFERENCE_KEY[row["kind"]]]


def compute_rewards(
    responses: list[str], references: list, kinds: list[str], num_workers: int = 4,
    stats: dict | None = None, timeout: float | None = None, code_partial: bool = False,
    code_timeout: float = CODE_TIMEOUT_S,
) -> list[float]:
    """Score a batch in parallel; order kept; `stats` (if given) receives timeouts and errors.

    Code scores 1 only when every test passes (code_partial: the fraction of stdio cases passed);
    code_timeout is each test's own limit in the sandbox. A response that runs past its hard limit
    (`timeout`, else MATH_TIMEOUT_S, or code_timeout times its number of tests) scores 0: its worker
    is killed and replaced, the rest of the batch goes on.
    """
    if not (len(responses) == len(references) == len(kinds)):
        raise ValueError("compute_rewards: responses, references and kinds differ in length")
    for k in set(kinds):
        if k not in KINDS:
            raise ValueError(f"unknown reward kind {k!r} (expected one of {', '.join(KINDS)})")
    if "code" in kinds:
        sandbox_mode()  # fail closed here, in the caller, not as a silent 0 in every worker
    scores = [0.0] * len(responses)
    counts = {"timeouts": 0, "errors": 0}
    todo = []
    for i in range(len(responses))[::-1]:
        # A boxed answer decided by string or integer comparison is scored here: most of a math
        # batch, without a round trip to a worker (last_boxed and normalize are linear-time).
        quick = None
        if kinds[i] == "math":
            try:
                boxed = last_boxed(responses[i])
                quick = quick_math_reward(boxed, str(references[i])) if boxed is not None else None
            except Exception:  # noqa: BLE001 - the worker decides (and reports) it
                quick = None
        if quick is None:
            todo.append(i)
        else:
            scores[i] = quick

    def job(i: int) -> str:
        return json.dumps({"i": i, "response": responses[i], "reference": references[i], "kind": kinds[i],
                           "partial": code_partial, "timeout": code_timeout,
                           "cpu": CODE_CHECK_CPU_S if kinds[i] == "code" else None})

    def limit(i: int) -> float:
        if timeout is not None:
            return timeout
        if kinds[i] == "code":
            ref = references[i] if isinstance(references[i], dict) else json.loads(references[i])
            return (code_timeout + 2) * max(1, len(ref.get("stdio", [0]))) + 5
        return MATH_TIMEOUT_S * 2 + 1  # parse and verify each have MATH_TIMEOUT_S inside

    with _pool_lock:
        _run_in_workers(todo, job, limit, scores, counts, num_workers)
    if stats is not None:
        stats.update(counts)
    return scores


def _run_in_workers(todo: list[int], job, limit, scores: list[float], counts: dict, num_workers: int) -> None:
    """Items `todo` (popped from the end) through the worker pool, each within its hard limit."""
    while len(_workers) < min(max(1, num_workers), len(todo)):
        _workers.append(_spawn())
    n_slots = min(max(1, num_workers), len(todo), len(_workers))
    busy: dict[int, tuple[int, float]] = {}  # worker slot -> (item, deadline)
    while todo or busy:
        for slot in range(n_slots):
            if slot not in busy and todo:
                i = todo.pop()
                try:
                    _workers[slot][0].stdin.write(job(i) + "\n")
                except (BrokenPipeError, OSError):  # a dead worker: replace it and retry
                    _replace(slot)[0].stdin.write(job(i) + "\n")
                busy[slot] = (i, time.monotonic() + limit(i))
        pipes = {_workers[s][0].stdout: s for s in busy}
        next_deadline = min(d for _, d in busy.values())
        for pipe in wait(list(pipes), timeout=max(0.0, next_deadline - time.monotonic())):
            slot = pipes[pipe]
            line = pipe.readline()
            if line:
                result = json.loads(line)
                scores[result["i"]] = result["score"]
                counts["errors"] += result["error"] is not None
            else:  # the worker died (e.g. killed by the OOM killer): score 0, replace it
                scores[busy[slot][0]] = 0.0
                counts["errors"] += 1
                _replace(slot)
            del busy[slot]
        now = time.monotonic()
        for slot, (i, deadline) in list(busy.items()):
            if now >= deadline:  # hard timeout: kill the worker, score 0, replace it
                _replace(slot)
                scores[i] = 0.0
                counts["timeouts"] += 1
                del busy[slot]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker_main(sys.argv[2], sys.argv[3])
