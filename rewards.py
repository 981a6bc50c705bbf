"""Rule-based verifiable rewards, shared by train_grpo.py and evaluate.py.

    math_reward(response, answer) -> 1.0 | 0.0
        final answer = last \\boxed{...} (or \\fbox, or `\\boxed x`), else the last `Answer: ...`
        line (DAPO-17k); compared by exact string first, then by mathematical equivalence
        with math-verify (fractions/decimals, \\sqrt, intervals, tuples, sets, units, %, ...).
    code_reward(response, tests) -> pass fraction
        last fenced Python block, run against {"test", "entry_point"} (HumanEval/MBPP) or
        {"stdio": [{"input", "output"}, ...]} (LiveCodeBench/Codeforces) in a sandbox.
    compute_rewards(responses, references, kinds, num_workers) -> list[float]
        a whole rollout batch in persistent worker processes, order kept; every item bounded
        by a hard timeout (the worker is killed and replaced), so nothing blocks the batch.

math-verify enforces its own timeouts with signal.alarm, which only works in a process's main
thread (elsewhere it silently scores 0): scoring therefore runs in the workers' main thread.

Model-written code is untrusted. It runs under bubblewrap (`apt-get install bubblewrap`):
without network, in its own PID namespace, with only the system's and Python's directories
visible (read-only), in a fresh temporary directory, with a minimal environment, as an
unprivileged user, under limits on CPU time, wall time, memory, processes, open files, file
size and the output read back (CODE_MAX_OUTPUT_BYTES), its whole process group killed at the
deadline. Without bubblewrap, code rewards refuse to run (fail closed) unless a weaker mode is
chosen explicitly with REWARDS_SANDBOX=unshare (no network, own PID namespace, but the whole
filesystem writable by `nobody`) or REWARDS_SANDBOX=rlimits (resource limits only).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait

log = logging.getLogger("rewards")

MATH_TIMEOUT_S = 5  # seconds (an int: math-verify hands it to signal.alarm)
MAX_ANSWER_CHARS = 1000  # longer "answers" are not worth symbolic verification
CODE_TIMEOUT_S = 10.0  # wall clock per test program
CODE_MEMORY_BYTES = 2 << 30
CODE_MAX_PROCS = 64
CODE_MAX_FILE_BYTES = 16 << 20
CODE_MAX_OUTPUT_BYTES = 4 << 20  # stdout read back from a program; past it the program is killed
SANDBOX_UID = 65534  # nobody

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


_TMP_ROOT: str | None = None  # a worker's private directory for sandboxes (see _spawn)
SANDBOX_MODES = ("bwrap", "unshare", "rlimits")  # strongest first; the weaker two only on request
_sandbox_mode: str | None = None


class SandboxUnavailable(RuntimeError):
    """Code rewards cannot run with the isolation asked for (REWARDS_SANDBOX, default bwrap)."""


def sandbox_mode() -> str:
    """The isolation for untrusted code: bubblewrap, or a weaker mode chosen by REWARDS_SANDBOX.

    Fails closed: raises SandboxUnavailable, with a one-line reason and the fix, rather than
    run model-written code with the trainer's reach.
    """
    global _sandbox_mode
    if _sandbox_mode is not None:
        return _sandbox_mode
    mode = os.environ.get("REWARDS_SANDBOX", "bwrap")
    if mode not in SANDBOX_MODES:
        raise SandboxUnavailable(f"REWARDS_SANDBOX={mode!r}: choose one of {', '.join(SANDBOX_MODES)}")
    if mode == "bwrap" and not shutil.which("bwrap"):
        raise SandboxUnavailable(
            "code rewards run model-written code and need bubblewrap to isolate it: install it "
            "(apt-get install bubblewrap), or set REWARDS_SANDBOX=unshare or rlimits to accept weaker "
            "isolation (README: Rewards)")
    if mode == "bwrap" and not _runs(_bwrap_prefix("/tmp") + [_sandbox_python("bwrap"), "-c", "pass"]):
        raise SandboxUnavailable(
            "bubblewrap is installed but cannot start a sandbox here (are unprivileged user namespaces "
            "disabled?); fix that, or set REWARDS_SANDBOX=unshare or rlimits to accept weaker isolation")
    if mode == "unshare" and not (shutil.which("unshare") and _runs(_unshare_prefix() + [sys.executable, "-c", ""])):
        raise SandboxUnavailable("REWARDS_SANDBOX=unshare: `unshare --net --pid` does not work on this machine")
    if mode != "bwrap":
        log.warning("REWARDS_SANDBOX=%s: untrusted code runs without filesystem isolation%s", mode,
                    "" if mode == "unshare" else ", network or PID namespace")
    _sandbox_mode = mode
    return mode


def _runs(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _bwrap_prefix(workdir: str) -> list[str]:
    # Only the system's and the interpreter's directories are visible, read-only; the
    # project, checkpoints and home directories are not there at all.
    binds = []
    for d in ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc"):
        if os.path.exists(d):
            binds += ["--ro-bind", d, d]
    # The interpreter's installation goes to /py: its own parents (e.g. /root) may not be
    # traversable by the unprivileged user the program runs as.
    binds += ["--ro-bind", sys.base_prefix, "/py"]
    return ["bwrap", *binds, "--tmpfs", "/tmp", "--bind", workdir, "/sandbox", "--chdir", "/sandbox",
            "--proc", "/proc", "--dev", "/dev", "--unshare-net", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--die-with-parent", "--new-session"]


def _sandbox_python(mode: str) -> str:
    exe = os.path.realpath(sys.executable)
    if mode == "bwrap":
        return os.path.join("/py", os.path.relpath(exe, sys.base_prefix))
    return exe


def _sandbox_uid(mode: str) -> int:
    """The uid to run untrusted code as: nobody, unless it could not read the interpreter."""
    if os.geteuid() != 0:
        return -1  # not root: already unprivileged
    if mode == "bwrap":
        return SANDBOX_UID
    path = sys.base_prefix
    while path != os.path.dirname(path):  # every parent must be world-traversable
        if not os.stat(path).st_mode & 0o001:
            log.warning("%s is not readable by uid %d: untrusted code runs as root", path, SANDBOX_UID)
            return -1
        path = os.path.dirname(path)
    return SANDBOX_UID


def _unshare_prefix() -> list[str]:
    return ["unshare", "--net", "--pid", "--fork", "--kill-child"]


# Runs inside the sandbox before the untrusted program: limits, then drop root.
_BOOTSTRAP = """
import os, resource, runpy, sys
cpu, mem, procs, fsize, uid = {limits}
for what, n in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(what, (n, n))
if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


def run_sandboxed(program: str, stdin: str = "", timeout: float = CODE_TIMEOUT_S) -> tuple[int, str, bool]:
    """Run a Python program in the sandbox; returns (exit code, stdout, timed out)."""
    mode = sandbox_mode()
    workdir = tempfile.mkdtemp(prefix="reward-", dir=_TMP_ROOT)
    try:
        os.chmod(workdir, 0o777)  # the program runs as nobody
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(program)
        limits = (math.ceil(timeout) + 1, CODE_MEMORY_BYTES, CODE_MAX_PROCS, CODE_MAX_FILE_BYTES, _sandbox_uid(mode))
        python = [_sandbox_python(mode), "-I", "-c", _BOOTSTRAP.format(limits=limits)]
        if mode == "bwrap":
            cmd, cwd = _bwrap_prefix(workdir) + python, workdir
        elif mode == "unshare":
            cmd, cwd = _unshare_prefix() + python, workdir
        else:
            cmd, cwd = python, workdir
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        # A pipe (what is read cannot be re-read: the harness's nonce stays secret), fed from a
        # thread so that a program which writes before it reads cannot deadlock us.
        threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True).start()
        try:
            return _read_bounded(proc, time.monotonic() + timeout)
        finally:
            _kill_group(proc)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:  # the program exited (or was killed) without reading it all
        pass


def _read_bounded(proc: subprocess.Popen, deadline: float) -> tuple[int, str, bool]:
    """(exit code, stdout, timed out), reading at most CODE_MAX_OUTPUT_BYTES: memory and time stay
    bounded whatever the program writes; past the cap it is killed (by the caller) and fails."""
    out, size, fd = [], 0, proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return -9, "", True
        if not select.select([fd], [], [], left)[0]:
            continue
        data = os.read(fd, 1 << 16)
        if not data:  # EOF: the program (and anything it started) closed its stdout
            break
        size += len(data)
        if size > CODE_MAX_OUTPUT_BYTES:
            return -9, "", False
        out.append(data)
    try:
        rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return -9, "", True
    return rc, b"".join(out).decode(errors="replace"), False


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass


def _normalize_output(s: str) -> str:
    return "\n".join(line.rstrip() for line in s.strip().splitlines())


def code_reward(response: str, tests: dict | str, binary: bool = False, timeout: float = CODE_TIMEOUT_S) -> float:
    """Fraction of tests passed (or 1/0 with binary=True). Never raises."""
    try:
        if isinstance(tests, str):
            tests = json.loads(tests)
        code = extract_code(response)
        if code is None:
            return 0.0
        if "stdio" in tests:
            cases = tests["stdio"]
            passed = 0
            for case in cases:
                rc, out, timed_out = run_sandboxed(code, case["input"], timeout)
                passed += rc == 0 and not timed_out and _normalize_output(out) == _normalize_output(case["output"])
            score = passed / len(cases) if cases else 0.0
        else:
            # The harness reads a nonce before the solution runs and prints it only after
            # check() returns, so an early sys.exit(0) or a printed "PASS" does not count.
            nonce = secrets.token_hex(16)
            harness = (
                "import sys\n_n = sys.stdin.readline().strip()\nsys.stdin = open('/dev/null')\n"
                f"_ns = {{'__name__': 'solution'}}\nexec({tests.get('prelude', '')!r}, _ns)\n"
                f"exec(compile({code!r}, 'solution.py', 'exec'), _ns)\n"
                f"_f = _ns[{tests['entry_point']!r}]\n"  # before the tests' own names can shadow it
                f"exec(compile({tests['test']!r}, 'test.py', 'exec'), _ns)\n"
                f"_ns['check'](_f)\nprint(_n, flush=True)\n"
            )
            rc, out, timed_out = run_sandboxed(harness, nonce + "\n", timeout)
            score = float(rc == 0 and not timed_out and out.strip().endswith(nonce))
        return float(score == 1.0) if binary else float(score)
    except SandboxUnavailable:
        raise  # a machine without the sandbox must not silently score every program 0
    except Exception:
        return 0.0


# -----------------------------------------------------------------------------
# Batch scoring in persistent worker processes with a hard per-item timeout


def score_one(response: str, reference, kind: str) -> float:
    if kind == "math":
        return math_reward(response, str(reference))
    if kind == "code":
        return code_reward(response, reference)
    raise ValueError(f"unknown reward kind {kind!r} (expected 'math' or 'code')")


def _worker_main(tmp_root: str) -> None:
    """A scoring worker: JSON lines in on stdin, JSON lines out on stdout, in its main thread."""
    global _TMP_ROOT
    _TMP_ROOT = tmp_root
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers end
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints (e.g. from libraries) must not corrupt the channel
    for line in sys.stdin:
        job = json.loads(line)
        try:
            score, err = score_one(job["response"], job["reference"], job["kind"]), None
        except Exception as e:  # noqa: BLE001 - reported as an error count, scored 0
            score, err = 0.0, repr(e)[:200]
        out.write(json.dumps({"i": job["i"], "score": score, "error": err}) + "\n")
        out.flush()


# Workers are plain subprocesses (`python rewards.py --worker DIR`), so they import neither the
# caller's main module nor torch. Each keeps its sandboxes in a directory of its own, which
# the parent removes if it has to kill the worker mid-item.
_workers: list[tuple[subprocess.Popen, str]] = []


def _spawn() -> tuple[subprocess.Popen, str]:
    tmp_root = tempfile.mkdtemp(prefix="rewards-pool-")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", tmp_root],
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


def compute_rewards(
    responses: list[str], references: list, kinds: list[str], num_workers: int = 4,
    stats: dict | None = None, timeout: float | None = None,
) -> list[float]:
    """Score a batch in parallel; order kept; `stats` (if given) receives timeouts and errors.

    A response that runs past its limit (MATH_TIMEOUT_S, or the code limit times its number
    of tests) scores 0: its worker is killed and replaced, the rest of the batch goes on.
    """
    if not (len(responses) == len(references) == len(kinds)):
        raise ValueError("compute_rewards: responses, references and kinds differ in length")
    for k in set(kinds):
        if k not in ("math", "code"):
            raise ValueError(f"unknown reward kind {k!r} (expected 'math' or 'code')")
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
    while len(_workers) < min(max(1, num_workers), len(todo)):
        _workers.append(_spawn())
    n_slots = min(max(1, num_workers), len(todo), len(_workers))
    busy: dict[int, tuple[int, float]] = {}  # worker slot -> (item, deadline)

    def limit(i: int) -> float:
        if timeout is not None:
            return timeout
        if kinds[i] == "code":
            ref = references[i] if isinstance(references[i], dict) else json.loads(references[i])
            return (CODE_TIMEOUT_S + 2) * max(1, len(ref.get("stdio", [0]))) + 5
        return MATH_TIMEOUT_S * 2 + 1  # parse and verify each have MATH_TIMEOUT_S inside

    while todo or busy:
        for slot in range(n_slots):
            if slot not in busy and todo:
                i = todo.pop()
                job = json.dumps({"i": i, "response": responses[i], "reference": references[i], "kind": kinds[i]})
                try:
                    _workers[slot][0].stdin.write(job + "\n")
                except (BrokenPipeError, OSError):  # a dead worker: replace it and retry
                    _replace(slot)[0].stdin.write(job + "\n")
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
    if stats is not None:
        stats.update(counts)
    return scores


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker_main(sys.argv[2])
