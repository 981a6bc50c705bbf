"""No channel and no shared limit between sandboxes.

A response must be scored alone: nothing it leaves behind may reach a later sandbox, nothing it
does may reach one running beside it, and what it holds (processes, disk) must not cut what
another gets. The probes below try every channel a program has: the kernel keyring, SysV shared
memory, message queues and semaphores, POSIX message queues and shared memory, files in every
writable place, abstract Unix sockets and process names. Each probe is shown to carry its value
inside one sandbox (or, for the keyring, with the seccomp filter taken away), so a test that finds
nothing across sandboxes could have found something.
"""

import errno
import glob
import inspect
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time

import pytest
from conftest import BENCHMARKS, ROOT

import rewards
from data.prepare import load_rows
from rewards import compute_rewards
from sandboxed import sandbox

pytestmark = pytest.mark.skipif(not shutil.which("bwrap"), reason="bubblewrap's isolation is what is tested")
# As root every sandbox has a uid of its own; the controls give them all one, as sandboxes had before.
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a uid per sandbox is the root path")

# The writer puts VALUE wherever it can; the reader looks for it everywhere; both print what they did.
_WRITER = r'''
import ctypes, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
VALUE, TAG, HOLD, NR = {value!r}, {tag!r}, {hold!r}, {nr!r}
KEY = int(TAG[:6], 16)
sent = {{}}

def attempt(name, fn):
    try:
        fn()
        sent[name] = "sent"
    except Exception as e:
        sent[name] = repr(e)[:80]

def check(ret):
    if ret == -1 or ret is None:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return ret

def keyring(ring):
    def put():
        data = VALUE.encode()
        check(libc.syscall(NR["add_key"], b"user", ("chan-" + TAG).encode(), data, len(data), ring))
    return put

def sysv_shm():
    ident = check(libc.shmget(KEY, 4096, 0o1000 | 0o666))
    ctypes.memmove(check(libc.shmat(ident, None, 0)), VALUE.encode(), len(VALUE))

def sysv_msg():
    ident = check(libc.msgget(KEY, 0o1000 | 0o666))
    msg = ctypes.create_string_buffer(8 + 64)
    ctypes.c_long.from_buffer(msg).value = 1
    msg[8 : 8 + len(VALUE)] = VALUE.encode()
    check(libc.msgsnd(ident, msg, 64, 0o4000))

def sysv_sem():
    ident = check(libc.semget(KEY, 1, 0o1000 | 0o666))
    check(libc.semctl(ident, 0, 16, ctypes.c_int(int(VALUE[-3:], 16))))  # SETVAL (at most SEMVMX, 32767)

def posix_mq():
    mq = check(libc.mq_open(("/chan-" + TAG).encode(), os.O_CREAT | os.O_RDWR, 0o666, None))
    check(libc.mq_send(mq, VALUE.encode(), len(VALUE), 0))

def write_file(path):
    def put():
        with open(path, "w") as f:
            f.write(VALUE)
    return put

def abstract_socket():
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0chan-" + TAG)
    server.listen(8)
    if os.fork() == 0:  # serves VALUE to whoever connects, while this sandbox lives
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        while True:
            conn, _ = server.accept()
            conn.sendall(VALUE.encode())
            conn.close()

def process_name():
    if os.fork() == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        libc.prctl(15, ("v" + VALUE[-12:]).encode(), 0, 0, 0)  # PR_SET_NAME: what /proc/PID/comm shows
        time.sleep(3600)

for ring, name in ((-4, "user"), (-5, "user-session"), (-3, "session")):
    attempt("keyring:" + name, keyring(ring))
for name, fn in (("sysv-shm", sysv_shm), ("sysv-msg", sysv_msg), ("sysv-sem", sysv_sem), ("posix-mq", posix_mq),
                 ("abstract-socket", abstract_socket), ("process-name", process_name)):
    attempt(name, fn)
for path in ("/tmp", "/sandbox", "/dev/shm", "/dev/mqueue", "/var/tmp", "/dev", os.path.expanduser("~"), "/"):
    attempt("file:" + path, write_file(os.path.join(path, "chan-" + TAG)))
print("uid", os.getuid(), "sent", sorted(k for k, v in sent.items() if v == "sent"), flush=True)
time.sleep(HOLD)
'''

_READER = r'''
import ctypes, glob, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
VALUE, TAG, WAIT, NR, CLEAR = {value!r}, {tag!r}, {wait!r}, {nr!r}, {clear!r}
KEY = int(TAG[:6], 16)
time.sleep(WAIT)
found = []

def look(name, fn):
    # A semaphore carries VALUE's last 3 hex digits, and its value is compared whole; the rest are searched
    # for VALUE's last 12 (a process name holds 15 characters): 3 digits, searched for in the hex of the
    # reader's own command lines, turned up by chance in 1 reading of 30.
    try:
        got = fn()
    except Exception:
        return
    if got and (got == VALUE[-3:] if name == "sysv-sem" else
                VALUE.encode()[-12:] in (got if isinstance(got, bytes) else str(got).encode())):
        found.append(name)

def keyring(ring):
    def get():
        key = libc.syscall(NR["keyctl"], 10, ring, b"user", ("chan-" + TAG).encode(), 0)  # KEYCTL_SEARCH
        buf = ctypes.create_string_buffer(256)
        n = libc.syscall(NR["keyctl"], 11, key, buf, 256)  # KEYCTL_READ
        return buf.raw[: max(n, 0)] if key >= 0 else None
    return get

def sysv_shm():
    ident = libc.shmget(KEY, 0, 0)
    return ctypes.string_at(libc.shmat(ident, None, 0), len(VALUE)) if ident >= 0 else None

def sysv_msg():
    ident = libc.msgget(KEY, 0)
    msg = ctypes.create_string_buffer(8 + 64)
    return msg.raw[8:] if ident >= 0 and libc.msgrcv(ident, msg, 64, 0, 0o4000) >= 0 else None

def sysv_sem():
    ident = libc.semget(KEY, 0, 0)
    return "%03x" % libc.semctl(ident, 0, 12) if ident >= 0 else None  # GETVAL

def posix_mq():
    mq = libc.mq_open(("/chan-" + TAG).encode(), os.O_RDONLY | os.O_NONBLOCK)
    buf = ctypes.create_string_buffer(1 << 16)
    n = libc.mq_receive(mq, buf, 1 << 16, None) if mq >= 0 else -1
    return buf.raw[: max(n, 0)]

def abstract_socket():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    s.connect("\0chan-" + TAG)
    return s.recv(256)

def process_names():
    names = []
    for path in glob.glob("/proc/[0-9]*/comm") + glob.glob("/proc/[0-9]*/cmdline"):
        try:
            names.append(open(path, "rb").read())
        except OSError:
            pass
    return b" ".join(names)

def files():
    seen = []
    for d in ("/tmp", "/sandbox", "/dev/shm", "/dev/mqueue", "/var/tmp", "/dev", os.path.expanduser("~"), "/"):
        path = os.path.join(d, "chan-" + TAG)
        try:
            seen.append(open(path, "rb").read())
        except OSError:
            pass
    return b" ".join(seen)

for ring, name in ((-4, "user"), (-5, "user-session"), (-3, "session")):
    look("keyring:" + name, keyring(ring))
for name, fn in (("sysv-shm", sysv_shm), ("sysv-msg", sysv_msg), ("sysv-sem", sysv_sem), ("posix-mq", posix_mq),
                 ("abstract-socket", abstract_socket), ("process-name", process_names), ("file", files)):
    look(name, fn)
if CLEAR:  # the keyring control leaves nothing in the kernel
    for ring in (-4, -5, -3):
        libc.syscall(NR["keyctl"], 7, ring)  # KEYCTL_CLEAR
print("uid", os.getuid(), "found", sorted(found), flush=True)
'''

# What one sandbox can pass to itself (written, then read back in the same sandbox): the probes work. A message
# queue and a socket it cannot make (the filter), nor read process names without /proc (limit.hide_proc).
WITHIN_ONE_SANDBOX = {"sysv-shm", "sysv-msg", "sysv-sem", "file"}


@pytest.fixture
def probed() -> None:
    """The start-up probe, run with the whole filter, before a control takes part of it away (the probe
    would refuse to start sandboxes without it)."""
    sandbox.sandbox_mode()


def numbers() -> dict:
    return {name: sandbox._syscall_number(name) for name in ("add_key", "keyctl")}


def writer(value: str, tag: str, hold: float = 0.0) -> str:
    return _WRITER.format(value=value, tag=tag, hold=hold, nr=numbers())


def reader(value: str, tag: str, wait: float = 0.0, clear: bool = False) -> str:
    return _READER.format(value=value, tag=tag, wait=wait, nr=numbers(), clear=clear)


def report(out: str, word: str) -> tuple[int, set]:
    """(uid, channel names) from a probe's line 'uid N <word> [...]'."""
    line = next(x for x in out.splitlines() if x.startswith("uid ") and f" {word} " in x)
    _, uid, _, names = line.split(" ", 3)
    return int(uid), set(eval(names))


def fresh() -> tuple[str, str]:
    return secrets.token_hex(8), secrets.token_hex(4)


def test_each_probe_carries_its_value_within_one_sandbox():
    value, tag = fresh()
    both = writer(value, tag) + "\n" + reader(value, tag, wait=0.3)  # the reader's part runs after the writer's
    _, out, _ = sandbox.run_sandboxed(both, timeout=10)
    (_, sent), (_, found) = report(out, "sent"), report(out, "found")
    assert not any(name.startswith("keyring") for name in sent), sent  # refused, even to itself
    assert {"file:/tmp", "file:/sandbox"} <= sent and not sent & {"file:/dev/shm", "file:/var/tmp", "file:/"}, sent
    assert not sent & {"posix-mq", "abstract-socket"} and "process-name" in sent, sent
    assert found == WITHIN_ONE_SANDBOX, found


def test_nothing_reaches_a_later_sandbox():
    value, tag = fresh()
    _, out_w, _ = sandbox.run_sandboxed(writer(value, tag), timeout=10)
    _, out_r, _ = sandbox.run_sandboxed(reader(value, tag), timeout=10)
    assert report(out_w, "sent")[1] >= {"sysv-shm", "file:/tmp"}, out_w
    assert report(out_r, "found")[1] == set(), out_r


@pytest.mark.slow  # it holds a sandbox for seconds (the quick tier stays under 3 minutes)
def test_nothing_reaches_a_sandbox_running_beside_it():
    value, tag = fresh()
    outs = {}

    def run(name: str, program: str) -> None:
        outs[name] = sandbox.run_sandboxed(program, timeout=10)[1]

    held = threading.Thread(target=run, args=("writer", writer(value, tag, hold=4.0)))
    held.start()
    time.sleep(1.0)  # the writer has written and holds its processes, sockets and names
    run("reader", reader(value, tag))
    held.join()
    (uid_w, sent), (uid_r, found) = report(outs["writer"], "sent"), report(outs["reader"], "found")
    assert {"process-name", "sysv-shm"} <= sent, outs["writer"]
    assert found == set(), outs["reader"]
    assert os.geteuid() != 0 or (uid_w != uid_r and {uid_w, uid_r} <= set(sandbox.SANDBOX_UIDS))


@as_root
def test_the_keyring_carries_values_without_the_filter(probed, monkeypatch):
    """The control: one uid for every sandbox and no seccomp filter (the sandbox before both), and
    the keyring carries the value to a later sandbox. The reader empties the keyrings it used."""
    monkeypatch.setattr(sandbox, "REFUSED_SYSCALLS", ())
    one = sandbox.SANDBOX_UIDS.start + secrets.randbelow(len(sandbox.SANDBOX_UIDS))
    monkeypatch.setattr(sandbox, "SANDBOX_UIDS", range(one, one + 1))
    value, tag = fresh()
    _, out_w, _ = sandbox.run_sandboxed(writer(value, tag), timeout=10)
    _, out_r, _ = sandbox.run_sandboxed(reader(value, tag, clear=True), timeout=10)
    assert {"keyring:user", "keyring:user-session"} <= report(out_w, "sent")[1], out_w
    assert {"keyring:user", "keyring:user-session"} <= report(out_r, "found")[1], out_r


def test_the_start_up_probe_fails_closed_without_the_filter(monkeypatch):
    monkeypatch.setattr(sandbox, "REFUSED_SYSCALLS", ())
    monkeypatch.setattr(sandbox, "_sandbox_mode", None)
    with pytest.raises(sandbox.SandboxUnavailable, match="keyring reachable"):
        sandbox.sandbox_mode()


UNPRIVILEGED_USER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]  # nobody


def unprivileged_python() -> str | None:
    """A Python the unprivileged user can run on this checkout (this interpreter may sit in a directory only
    root enters, such as /root)."""
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp"}
    system = [p for d in ("/usr/local/bin", "/usr/bin") for p in sorted(glob.glob(f"{d}/python3.1[1-9]"))]
    for python in dict.fromkeys([sys.executable, *system]):
        if shutil.which("setpriv"):
            res = subprocess.run([*UNPRIVILEGED_USER, python, "tests/score_as_user.py", "--ready"], cwd=ROOT,
                                 env=env, capture_output=True, text=True, timeout=60)
            if res.stdout.strip() == "ready":
                return python
    return None


@as_root
def test_without_root_code_rewards_refuse_in_one_line_unless_the_risk_is_accepted():
    # as an ordinary user every sandbox shares the scorer's uid, limits and the host's kernel counters: refused,
    # in the one line that says what to do, before any response is run; scored once the user accepts the risk
    python = unprivileged_python()
    if python is None:
        pytest.skip("no Python that an unprivileged user can run on this checkout")
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp"}
    cmd = [*UNPRIVILEGED_USER, python, "tests/score_as_user.py"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 3 and res.stdout.splitlines() == [sandbox.UNPRIVILEGED], res.stdout + res.stderr
    res = subprocess.run(cmd, cwd=ROOT, env={**env, "REWARDS_SANDBOX_UNPRIVILEGED": "1"}, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and json.loads(res.stdout) == [1.0, 0.0], res.stdout + res.stderr
    assert "REWARDS_SANDBOX_UNPRIVILEGED=1: sandboxes share this user's limits" in res.stderr


@as_root
def test_the_start_up_probe_fails_closed_with_device_nodes_open_to_stamps(monkeypatch):
    monkeypatch.setattr(sandbox, "SEAL_DEVICES", False)
    monkeypatch.setattr(sandbox, "_sandbox_mode", None)
    with pytest.raises(sandbox.SandboxUnavailable, match="device nodes' times writable"):
        sandbox.sandbox_mode()


# A user namespace of its own, where the program is root: it mounts a tmpfs there and fills it (memory
# outside every limit). After a fresh exec (the dropped uid makes the first image unable to write its maps).
_OWN_NAMESPACE = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
r = libc.unshare(0x10000000 | 0x20000)  # CLONE_NEWUSER | CLONE_NEWNS
print("unshare", r, ctypes.get_errno(), flush=True)
if r == 0:
    open("/proc/self/setgroups", "w").write("deny")
    open("/proc/self/uid_map", "w").write(f"0 {uid} 1")
    open("/proc/self/gid_map", "w").write(f"0 {gid} 1")
    os.makedirs("big", exist_ok=True)
    libc.mount(b"none", b"big", b"tmpfs", 0, b"size=1g")
    total = 0
    try:
        for i in range(16):
            with open(f"big/f{i}", "wb") as f:
                for _ in range(16):
                    f.write(b"x" * (1 << 20))
                    total += 1 << 20
    except OSError:
        pass
    print("wrote", total, flush=True)
'''
OWN_NAMESPACE = (f"import os, sys\nopen('inner.py', 'w').write({_OWN_NAMESPACE!r})\n"
                 "os.execv(sys.executable, [sys.executable, 'inner.py'])")


def test_no_namespace_of_its_own(monkeypatch):
    """unshare and clone with CLONE_NEW* flags are refused, while threads (clone3 answers ENOSYS, the C
    library falls back to clone), fork and exec work; without the filter's namespace rules the
    program mounts a tmpfs of its own and writes four times its disk bound into memory."""
    out = sandbox.run_sandboxed(OWN_NAMESPACE, timeout=10)[1]
    assert out.split() == ["unshare", "-1", "1"], out  # EPERM
    clone = sandbox._syscall_number("clone")
    works = ("import ctypes, os, sys, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             f"print(libc.syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno(), flush=True)\n"
             "t = threading.Thread(target=print, args=('thread',), kwargs={'flush': True})\nt.start()\nt.join()\n"
             "if os.fork() == 0:\n    os.execv(sys.executable, [sys.executable, '-c', 'print(5)'])\nos.wait()")
    assert sandbox.run_sandboxed(works, timeout=10)[1].split() == ["-1", "1", "thread", "5"]
    monkeypatch.setattr(sandbox, "REFUSED_SYSCALLS", ("add_key", "keyctl", "request_key"))
    monkeypatch.setattr(sandbox, "HIDE_PROC", False)  # its uid map is written through /proc
    out = sandbox.run_sandboxed(OWN_NAMESPACE, timeout=10)[1]
    assert int(out.split("wrote")[1]) == 256 << 20 > 4 * sandbox.CODE_MAX_DISK_BYTES - 1, out


@as_root
def test_running_sandboxes_never_share_a_uid():
    with sandbox._sandbox_uid("bwrap") as a, sandbox._sandbox_uid("bwrap") as b:
        assert a != b and {a, b} <= set(sandbox.SANDBOX_UIDS)
    # a uid given back can be claimed again
    with sandbox._sandbox_uid("bwrap") as c:
        name = f"\0balanced-grpo-sandbox-uid-{c}"
        probe = sandbox.socket.socket(sandbox.socket.AF_UNIX, sandbox.socket.SOCK_DGRAM)
        with pytest.raises(OSError):
            probe.bind(name)  # held while the sandbox runs
    probe.bind(name)
    probe.close()


# -- the copier and the oracle, on real problems -----------------------------------------------------

# A program's note in the keyring (its uid's user-session keyring, which every process of the uid reaches):
# one key per tag holding a table, kept within the kernel's quota of 200 keys and 20000 bytes per uid (a
# full keyring is emptied once, making room).
_KEYRING = r'''
import ctypes, hashlib
_libc = ctypes.CDLL(None, use_errno=True)
_NAME = ("note-" + {tag!r}).encode()
def _h(what):
    return hashlib.sha1(repr(what).encode()).hexdigest()[:10]
def _table():
    key = _libc.syscall({nr[keyctl]}, 10, -5, b"user", _NAME, 0)  # KEYCTL_SEARCH
    buf = ctypes.create_string_buffer(1 << 15)
    n = _libc.syscall({nr[keyctl]}, 11, key, buf, 1 << 15) if key >= 0 else -1  # KEYCTL_READ
    try:
        return eval(buf.raw[:n].decode()) if n > 0 else {{}}
    except Exception:
        return {{}}
def _publish(what, value):
    table = _table()
    table[_h(what)] = value
    data = repr(table).encode()
    if _libc.syscall({nr[add_key]}, b"user", _NAME, data, len(data), -5) < 0:
        _libc.syscall({nr[keyctl]}, 7, -5)  # KEYCTL_CLEAR
        _libc.syscall({nr[add_key]}, b"user", _NAME, data, len(data), -5)
def _lookup(what):
    return _table().get(_h(what))
'''


def keyring_helpers(tag: str) -> str:
    return _KEYRING.format(tag=tag, nr=numbers())


def publisher(solution: str, entry: str, tag: str) -> str:
    """A correct solution that also publishes what it returns for every input (the sibling that solved it)."""
    return (f"```python\n{solution}\n{keyring_helpers(tag)}\n_solve = {entry}\n"
            f"def {entry}(*args, **kwargs):\n    out = _solve(*args, **kwargs)\n"
            "    _publish((args, kwargs), out)\n    return out\n```")


def copier(entry: str, tag: str) -> str:
    """No solution: it answers what a sibling published for the same input."""
    return f"```python\n{keyring_helpers(tag)}\ndef {entry}(*args, **kwargs):\n    return _lookup((args, kwargs))\n```"


def stdio_publisher(cases: list[dict], tag: str) -> str:
    table = {c["input"]: c["output"] for c in cases}
    return (f"```python\nimport sys\n{keyring_helpers(tag)}\nT = {table!r}\ni = sys.stdin.read()\n"
            "_publish(i, T.get(i, ''))\nsys.stdout.write(T.get(i, ''))\n```")


def stdio_copier(tag: str) -> str:
    return f"```python\nimport sys\n{keyring_helpers(tag)}\nsys.stdout.write(_lookup(sys.stdin.read()) or '')\n```"


def humaneval(ids: set | None = None) -> list[dict]:
    raw = [json.loads(x) for x in (BENCHMARKS / "humaneval.jsonl").read_text().splitlines()]
    return [r for r in raw if ids is None or r["task_id"] in ids]


COPIED = {"HumanEval/0", "HumanEval/2", "HumanEval/13", "HumanEval/23", "HumanEval/55"}


def copy_pairs(rows: list[dict], stdio: list[dict], tag: str) -> tuple[list[str], list[dict]]:
    """(responses, tests): for each problem the publisher, then the copier."""
    responses, tests = [], []
    for i, r in enumerate(rows):
        t = {"test": r["test"], "entry_point": r["entry_point"], "prelude": r["prompt"]}
        responses += [publisher(r["prompt"] + r["canonical_solution"], r["entry_point"], f"{tag}-{i}"),
                      copier(r["entry_point"], f"{tag}-{i}")]
        tests += [t, t]
    for i, r in enumerate(stdio):
        responses += [stdio_publisher(r["tests"]["stdio"], f"{tag}-s{i}"), stdio_copier(f"{tag}-s{i}")]
        tests += [r["tests"], r["tests"]]
    return responses, tests


def lcb_stdio(n: int) -> list[dict]:
    return [r for r in load_rows("livecodebench", data_dir=str(BENCHMARKS)) if "stdio" in r["tests"]][:n]


def test_a_copier_gets_nothing_from_the_sibling_that_solved_it():
    responses, tests = copy_pairs(humaneval(COPIED), lcb_stdio(3), secrets.token_hex(4))
    scores = compute_rewards(responses, tests, ["code"] * len(responses), num_workers=1)  # in order
    assert scores[0::2] == [1.0] * (len(responses) // 2)  # the publishers solve their problems
    assert scores[1::2] == [0.0] * (len(responses) // 2)  # and the copiers get nothing from them


@as_root
def test_the_copier_wins_without_the_filter(probed, monkeypatch):
    """The control, in this process: one uid, no filter; the copier then scores with its sibling."""
    monkeypatch.setattr(sandbox, "REFUSED_SYSCALLS", ())
    one = sandbox.SANDBOX_UIDS.start + secrets.randbelow(len(sandbox.SANDBOX_UIDS))
    monkeypatch.setattr(sandbox, "SANDBOX_UIDS", range(one, one + 1))
    responses, tests = copy_pairs(humaneval(COPIED), lcb_stdio(3), secrets.token_hex(4))
    try:
        scores = [rewards.score_code(r, t) for r, t in zip(responses, tests)]
    finally:
        sandbox.run_sandboxed(reader("", "0" * 8, clear=True))
    assert scores == [1.0] * len(responses)


# The oracle: no solution; it guesses from a short list and remembers, across responses, which of its
# guesses was the last one asked before the check stopped (so the one that failed): the next response
# tries the next guess there. Answers of these problems are small (a bool, a small int).
_ORACLE = r'''
GUESSES = [True, False, 0, 1, 2, 3, -1]
_state = _lookup(({problem!r}, "state")) or {{}}
_last = _lookup(({problem!r}, "last"))
if _last is not None:  # the previous response stopped at this call
    _state[_last] = _state.get(_last, 0) + 1
    _publish(({problem!r}, "state"), _state)
def {entry}(*args, **kwargs):
    k = _h((args, kwargs))
    _publish(({problem!r}, "last"), k)
    return GUESSES[_state.get(k, 0) % len(GUESSES)]
'''

ORACLE_PROBLEMS = {"HumanEval/3", "HumanEval/52", "HumanEval/57"}  # answers are booleans


def oracle(entry: str, problem: str, tag: str) -> str:
    return f"```python\n{keyring_helpers(tag)}\n{_ORACLE.format(entry=entry, problem=problem)}\n```"


def oracle_rounds(score, rounds: int = 8) -> list[float]:
    rows, tag = humaneval(ORACLE_PROBLEMS), secrets.token_hex(4)
    per_round = []
    for _ in range(rounds):
        per_round.append(sum(score(oracle(r["entry_point"], r["task_id"], tag),
                                   {"test": r["test"], "entry_point": r["entry_point"], "prelude": r["prompt"]})
                             for r in rows))
    return per_round


def test_an_oracle_learns_nothing_across_responses():
    per_round = oracle_rounds(lambda response, tests: compute_rewards([response], [tests], ["code"], 1)[0])
    assert per_round == [0.0] * 8


@as_root
def test_the_oracle_learns_without_the_filter(probed, monkeypatch):
    monkeypatch.setattr(sandbox, "REFUSED_SYSCALLS", ())
    one = sandbox.SANDBOX_UIDS.start + secrets.randbelow(len(sandbox.SANDBOX_UIDS))
    monkeypatch.setattr(sandbox, "SANDBOX_UIDS", range(one, one + 1))
    try:
        per_round = oracle_rounds(rewards.score_code)
    finally:
        sandbox.run_sandboxed(reader("", "0" * 8, clear=True))
    assert per_round[0] == 0 and max(per_round) > 0, per_round  # it learned to pass some


# -- limits per sandbox ----------------------------------------------------------------------------

# A neighbour that takes every process its limit allows and holds them.
HOG = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            os.close(1)\n"
       "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\n"
       "print('held', n, flush=True)\ntime.sleep(6)\nos.close(1)")
# A correct solution that needs threads (a pool of 8), started once the neighbour holds its processes.
THREADED = ("```python\nimport time\nfrom concurrent.futures import ThreadPoolExecutor\ntime.sleep(1.5)\n"
            "n = int(input())\nwith ThreadPoolExecutor(8) as pool:\n"
            "    print(sum(pool.map(lambda i: i * i, range(n))))\n```")


@pytest.mark.slow  # it holds a sandbox for seconds (the quick tier stays under 3 minutes)
def test_a_neighbour_holding_its_processes_takes_none_from_the_others():
    hog = {}
    thread = threading.Thread(target=lambda: hog.update(out=sandbox.run_sandboxed(HOG, timeout=10)[1]))
    thread.start()
    time.sleep(0.5)
    tests = {"stdio": [{"input": "100\n", "output": str(sum(i * i for i in range(100)))}]}
    scores = compute_rewards([THREADED] * 8, [tests] * 8, ["code"] * 8, num_workers=8)
    thread.join()
    held = hog["out"].split()
    assert held[0] == "held" and int(held[1]) >= sandbox.CODE_MAX_PROCS - 4  # it reached its own limit
    assert scores == [1.0] * 8


# A neighbour whose children each make a session of their own (setsid: a new autogroup, which the scheduler
# weighs like a whole login session) and spin; and a correct program that needs about a second of CPU alone.
SESSION_HOG = ("import os, time\nfor _ in range(16):\n    if os.fork() == 0:\n        try:\n            os.setsid()\n"
               "        except OSError:\n            pass\n        while True:\n            pass\n"
               "print('spinning', flush=True)\ntime.sleep(30)")
CPU_BOUND = "n = int(input())\nprint(sum(i * i % 7 for i in range(n)))"


def next_to_session_hogs(n: int, alone_s: float | None = None, hogs: int = 3) -> tuple[float, tuple, tuple]:
    """CPU_BOUND's seconds alone, and its (exit code, output, timed out) while `hogs` SESSION_HOGs spin (started
    first, and spinning until it is over: their own deadline is far, and they are killed once it returns; its
    case starts only once its runner has started, itself as starved as the case), within a deadline of 6 times
    its time alone plus 0.5 s (its fair share on 2 cores beside 3 others: half a core, about 2 times slower;
    one session's share in 49: 25 to 50 times)."""
    times = []
    for _ in range(2):  # the faster of two: one run slowed by the suite's last engine must not lengthen the deadline
        t = time.perf_counter()
        alone = sandbox.run_sandboxed(CPU_BOUND, f"{n}\n", timeout=20)
        times.append(time.perf_counter() - t)
        assert alone[0] == 0 and not alone[2], alone
    alone_s = min(times + [alone_s or float("inf")])  # (the control keeps the faster of its and the measured one's)
    deadline = 6 * alone_s + 0.5
    threads = [threading.Thread(target=sandbox.run_sandboxed, args=(SESSION_HOG,), kwargs={"timeout": 60})
               for _ in range(hogs)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the hogs' children spin
    cores = os.sched_getaffinity(0)
    try:
        idle, t = idle_ticks(cores), time.perf_counter()
        beside = sandbox.run_sandboxed(CPU_BOUND, f"{n}\n", timeout=deadline)
        idle = (idle_ticks(cores) - idle) / os.sysconf("SC_CLK_TCK") / len(cores) / (time.perf_counter() - t)
    finally:  # every sandbox still running is a hog's
        base = sandbox._memory_bound()[1]
        for name in filter(str.isdigit, os.listdir(base)):
            sandbox._kill_cgroup(os.path.join(base, name))
        for thread in threads:
            thread.join()
    assert idle < 0.1, idle  # the hogs did spin: the cores idle under a tenth of the time (without them, half)
    return alone_s, alone, beside


def idle_ticks(cores: set[int]) -> int:
    """The idle time of these cores, summed (/proc/stat's idle column, clock ticks)."""
    names = {f"cpu{c}" for c in cores}
    with open("/proc/stat") as f:
        return sum(int(fields[4]) for fields in map(str.split, f) if fields[0] in names)


@as_root
@pytest.mark.slow  # about 7 s: three hogs spin beside a sibling, twice
def test_a_correct_sibling_keeps_its_cpu_next_to_hogs_of_many_sessions(probed, monkeypatch):
    """Every process of a sandbox shares one CPU weight (a cgroup of the cpu controller per sandbox, and one
    session: setsid is refused): three responses whose 16 children each try setsid and spin take a share each,
    not one per session. Without both the sibling gets about one share in 49 and misses its deadline."""
    if sandbox._memory_bound()[0] == "watchdog" or sandbox._cpu is None:
        pytest.skip("no cpu controller delegated here")
    n = 4_000_000  # about half a second alone
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(cores)[:2])  # 2 cores on any host: threads, and the sandboxes they start, inherit it
    try:
        alone_s, alone, beside = next_to_session_hogs(n)
        assert beside == alone, (alone_s, beside)  # the same answer, in time
        # the control: the hogs' sessions weighed one by one (their autogroups), as before
        monkeypatch.setattr(sandbox, "_cpu", None)
        rules = tuple(r for r in sandbox.seccomp_rules() if r[0] != "setsid")
        monkeypatch.setattr(sandbox, "seccomp_rules", lambda: rules)
        control_s, _, starved = next_to_session_hogs(n, alone_s)
        assert starved[2], (control_s, starved)  # timed out
    finally:
        os.sched_setaffinity(0, cores)


# Fills loopback TCP connections' buffers (a reader that never reads), as far as it gets.
TCP_FILLER = ("import socket, time\ntry:\n    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
              "    server.bind(('127.0.0.1', 0))\n    server.listen(64)\n    held, sent = [], 0\n"
              "    for _ in range(32):\n        c = socket.create_connection(server.getsockname())\n"
              "        held += [c, server.accept()[0]]\n        c.setblocking(False)\n        try:\n"
              "            while True:\n                sent += c.send(b'x' * 65536)\n"
              "        except BlockingIOError:\n            pass\n    print('sent', sent, flush=True)\n"
              "    time.sleep(3)\nexcept OSError as e:\n    print('refused', e.errno, flush=True)")


def tcp_memory_pages() -> int:
    """The host's TCP buffers, pages (/proc/net/sockstat's TCP mem)."""
    with open("/proc/net/sockstat") as f:
        return next(int(line.split("mem")[1].split()[0]) for line in f if line.startswith("TCP:"))


@pytest.mark.slow  # a sandbox start and the probe's, about 5 s (the quick tier stays under 3 minutes)
def test_a_loopback_tcp_filler_holds_no_kernel_memory_outside_its_budget():
    """Socket buffers of inet sockets are charged to the host's TCP pool, not to the sandbox's memory cgroup: a
    sandbox gets no socket at all (the filter), so the filler gets none and the host's TCP memory does
    not grow by what it would have sent (1 GiB beside a 1.5 GiB sandbox, unfiltered)."""
    before = tcp_memory_pages()
    rc, out, _ = sandbox.run_sandboxed(TCP_FILLER, timeout=10)
    assert out.split() == ["refused", str(errno.EAFNOSUPPORT)], out
    assert tcp_memory_pages() - before < 4096  # 16 MiB: the host's own connections come and go meanwhile


# Writes 16 MiB files (the file-size limit) into every writable place it has, until none takes more.
DISK = ("total, dirs, i = 0, ['.', '/tmp'], 0\nwhile dirs and i < 64:\n    d = dirs[i % len(dirs)]\n    try:\n"
        "        with open(f'{d}/f{i}', 'wb') as f:\n            for _ in range(16):\n"
        "                f.write(b'x' * (1 << 20))\n                total += 1 << 20\n    except OSError:\n"
        "        dirs.remove(d)\n    i += 1\nprint(total)")


def test_disk_use_is_bounded_per_sandbox():
    t0 = time.time()
    rc, out, _ = sandbox.run_sandboxed(DISK, timeout=10)
    written = int(out.split()[0])
    assert sandbox.CODE_MAX_DISK_BYTES - (16 << 20) <= written <= sandbox.CODE_MAX_DISK_BYTES
    assert time.time() - t0 < 5


# -- what sandboxes share: the host kernel's state of the files they all read ----------------------------
# The programs are functions here, run in the sandbox from their source (ship): each channel's writer puts
# BITS (a secret, as 0s and 1s) where a sibling could read them and prints them (a stdio answer that
# scores); its reader prints what it read (a copier that scores only if the channel carried the answer).


def ship(fn, *args) -> str:
    """A program that defines `fn` (and stdlib_file) from its source and calls it with `args`."""
    return f"{inspect.getsource(stdlib_file)}\n{inspect.getsource(fn)}\n{fn.__name__}(*{args!r})\n"


def as_response(program: str) -> str:
    return f"```python\n{program}```"


def stdlib_file(name: str) -> str:
    import os

    return os.path.join(os.path.dirname(os.__file__), name)  # the sandbox's own copy (or /py/...), read-only


def lock_writer(bits: str, base: int, hold: float) -> None:
    """Read locks (a read-only descriptor is enough) at the offsets of its 1 bits, and a shared flock."""
    import fcntl
    import time

    f = open(stdlib_file("LICENSE.txt"), "rb")  # noqa: SIM115 - held while it sleeps
    for i, bit in enumerate(bits):
        if bit == "1":
            try:
                fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, base + i)
            except OSError:
                pass
    try:
        fcntl.flock(f, fcntl.LOCK_SH)
    except OSError:
        pass
    print(bits, flush=True)
    time.sleep(hold)


def lock_reader(n: int, base: int, wait: float) -> None:
    """F_GETLK and F_OFD_GETLK at each offset: a lock held there is a 1; a refused probe reads nothing."""
    import fcntl
    import struct
    import time

    time.sleep(wait)
    f = open(stdlib_file("LICENSE.txt"), "rb")  # noqa: SIM115
    bits = ""
    for i in range(n):
        for cmd in (fcntl.F_GETLK, 36):  # F_OFD_GETLK
            try:
                got = fcntl.fcntl(f, cmd, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, base + i, 1, 0))
                bits += "0" if struct.unpack("hhqqi4x", got)[0] == fcntl.F_UNLCK else "1"
                break
            except OSError:
                continue
    print(bits, flush=True)


def secret_bits(n: int = 48) -> str:
    return format(secrets.randbits(n) | 1 << (n - 1), "b")


def lock_pair() -> tuple[list[str], list[dict]]:
    bits, base = secret_bits(), secrets.randbelow(1 << 40)
    tests = {"stdio": [{"input": "", "output": bits}]}
    return ([as_response(ship(lock_writer, bits, base, 3.0)), as_response(ship(lock_reader, len(bits), base, 1.0))],
            [tests, tests])


def test_a_lock_copier_scores_nothing_beside_the_sibling_that_solved_it(clean_machine):
    """The writer scores; the copier, running beside it (two workers), reads no lock of it."""
    responses, tests = lock_pair()
    assert compute_rewards(responses, tests, ["code"] * 2, num_workers=2) == [1.0, 0.0]


@pytest.mark.slow  # it holds a sandbox for seconds (the quick tier stays under 3 minutes)
def test_locks_carry_the_answer_without_the_filter(probed, monkeypatch):
    """The control: without the rules on shared state, the copier reads the writer's locks and scores."""
    monkeypatch.setattr(sandbox, "SHARED_STATE_RULES", ())
    responses, tests = lock_pair()
    scores = {}
    writer_thread = threading.Thread(target=lambda: scores.update(w=rewards.score_code(responses[0], tests[0])))
    writer_thread.start()
    scores["r"] = rewards.score_code(responses[1], tests[1])
    writer_thread.join()
    assert scores == {"w": 1.0, "r": 1.0}


def lock_in_high_bits() -> None:
    """F_GETLK with bits set above the 32 the kernel reads: the filter must not see another command."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(stdlib_file("LICENSE.txt"), os.O_RDONLY)
    lock = ctypes.create_string_buffer(32)
    print(libc.syscall(72, fd, ctypes.c_long(1 << 32 | 5), lock), ctypes.get_errno())  # fcntl, F_GETLK


def test_lock_commands_cannot_hide_in_high_bits():
    assert sandbox._syscall_number("fcntl") == 72 or pytest.skip("x86-64's numbers")
    assert sandbox.run_sandboxed(ship(lock_in_high_bits), timeout=10)[1].split() == ["-1", str(errno.EINVAL)]


def test_the_start_up_probe_fails_closed_where_locks_are_shared(monkeypatch):
    monkeypatch.setattr(sandbox, "SHARED_STATE_RULES", ())
    monkeypatch.setattr(sandbox, "_sandbox_mode", None)
    with pytest.raises(sandbox.SandboxUnavailable, match="locks shared"):
        sandbox.sandbox_mode()


def open_watcher(wait: float) -> None:
    """Watches a shared file with inotify: an open or read by any process on the machine is an event."""
    import ctypes
    import select

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    if fd < 0 or libc.inotify_add_watch(fd, stdlib_file("LICENSE.txt").encode(), 0x20 | 0x1) < 0:  # OPEN, ACCESS
        print("refused", ctypes.get_errno(), flush=True)
        return
    print("event" if select.select([fd], [], [], wait)[0] else "nothing", flush=True)


def test_no_sandbox_sees_another_open_a_shared_file():
    """inotify (and dnotify, fanotify) watch inodes: one sandbox would see another open the file it names."""
    out = {}
    watcher = threading.Thread(target=lambda: out.update(w=sandbox.run_sandboxed(ship(open_watcher, 2.0))[1]))
    watcher.start()
    time.sleep(0.5)
    sandbox.run_sandboxed("import os\nopen(os.path.join(os.path.dirname(os.__file__), 'LICENSE.txt')).read(1)")
    watcher.join()
    assert out["w"].split()[0] == "refused", out


def cache_writer(bits: str, name: str) -> None:
    """Evicts a shared file from the host's page cache, then loads the pages of its 1 bits."""
    import os

    fd = os.open(stdlib_file(name), os.O_RDONLY)
    for advice in (os.POSIX_FADV_DONTNEED, os.POSIX_FADV_RANDOM):  # RANDOM: no readahead past a page
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass
    for i, bit in enumerate(bits):
        if bit == "1":
            os.pread(fd, 1, i * 4096)
    print(bits, flush=True)


def cache_reader(n: int, name: str) -> None:
    """Which of the file's pages are cached, without loading them: cachestat, else a no-wait read (after
    POSIX_FADV_RANDOM, so that a miss loads no neighbour), else mincore; a refused probe reads nothing."""
    import ctypes
    import errno
    import mmap
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(stdlib_file(name), os.O_RDONLY)

    def cachestat(i):
        span, stat = (ctypes.c_uint64 * 2)(i * 4096, 4096), (ctypes.c_uint64 * 5)()
        if libc.syscall(451, fd, span, stat, 0) != 0:
            raise OSError(ctypes.get_errno(), "cachestat")
        return stat[0] > 0

    def nowait(i):
        try:
            return os.preadv(fd, [bytearray(1)], i * 4096, os.RWF_NOWAIT) == 1
        except BlockingIOError:
            return False

    pages = mmap.mmap(fd, n * 4096, access=mmap.ACCESS_COPY)
    vec = ctypes.create_string_buffer(n)

    def mincore(i):
        if i == 0 and libc.mincore(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(pages))),
                                   ctypes.c_size_t(n * 4096), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return vec.raw[i] & 1

    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError:
        pass
    for probe in (cachestat, nowait, mincore):
        try:
            print("".join("1" if probe(i) else "0" for i in range(n)), flush=True)
            return
        except OSError as e:
            assert e.errno in (errno.ENOSYS, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP), e
    print("", flush=True)


def cache_pair(bits: str) -> tuple[list[str], dict]:
    """(writer, reader) on a large shared file chosen at random (so that runs beside it collide rarely)."""
    lib = (sandbox._sandbox_root() or "") + os.path.realpath(os.path.dirname(os.__file__))  # what sandboxes see
    big = sorted(os.path.relpath(os.path.join(d, f), lib) for d, _, files in os.walk(lib) for f in files
                 if f.endswith(".py") and os.path.getsize(os.path.join(d, f)) > 4096 * (len(bits) + 1))
    name = secrets.choice(big)
    tests = {"stdio": [{"input": "", "output": bits}]}
    return [as_response(ship(cache_writer, bits, name)), as_response(ship(cache_reader, len(bits), name))], tests


def test_a_page_cache_copier_in_a_later_batch_scores_nothing(clean_machine):
    bits = secret_bits()
    (writer_, reader_), tests = cache_pair(bits)
    assert compute_rewards([writer_], [tests], ["code"], num_workers=1) == [1.0]
    assert compute_rewards([reader_], [tests], ["code"], num_workers=1) == [0.0]  # the batch after
    program = reader_.removeprefix("```python\n").removesuffix("```")
    assert sandbox.run_sandboxed(program, timeout=10)[1] == "\n"  # every probe refused: not even a guess


def test_the_page_cache_carries_the_answer_without_the_filter(probed, monkeypatch):
    monkeypatch.setattr(sandbox, "SHARED_STATE_RULES", ())
    if sandbox._sandbox_root():  # the sandbox root alone closes it too: every page of it is always cached
        (writer_, reader_), tests = cache_pair(secret_bits())
        assert [rewards.score_code(writer_, tests), rewards.score_code(reader_, tests)] == [1.0, 0.0]
    monkeypatch.setattr(sandbox, "_root", False)  # the host's directories, as an unprivileged scorer has them

    def copied() -> list[float]:
        (writer_, reader_), tests = cache_pair(secret_bits())
        return [rewards.score_code(writer_, tests), rewards.score_code(reader_, tests)]

    # Now and then the kernel caches a read's neighbour page too (a large folio): 2 of 40 pairs read one wrong
    # bit, each next to a set one. The control asks whether the channel carries an answer: up to 3 pairs.
    assert any(copied() == [1.0, 1.0] for _ in range(3))


def evictions() -> None:
    """What evicting a shared file's pages each answers (fadvise, madvise PAGEOUT and COLD, readahead)."""
    import ctypes
    import errno
    import mmap
    import os

    fd = os.open(stdlib_file("LICENSE.txt"), os.O_RDONLY)
    pages = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
    said = []
    for fn in (lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED), lambda: pages.madvise(21),
               lambda: pages.madvise(20)):
        try:
            fn()
            said.append("done")
        except OSError as e:
            said.append(errno.errorcode[e.errno])
    libc = ctypes.CDLL(None, use_errno=True)
    said.append("done" if libc.readahead(fd, ctypes.c_long(0), ctypes.c_size_t(4096)) == 0 else
                errno.errorcode[ctypes.get_errno()])
    print(*said)


def test_no_sandbox_evicts_shared_pages():
    assert sandbox.run_sandboxed(ship(evictions), timeout=10)[1].split() == ["EPERM", "EINVAL", "EINVAL", "EPERM"]


def kernel_hog(seconds: float, hold: float) -> None:
    """Pins kernel memory that the tmpfs's size does not count: 8191-entry ACLs and 64 KiB user xattrs on
    as many (empty) files as it may make; then holds them. Prints files made and xattr bytes set."""
    import os
    import struct
    import time

    entry = struct.Struct("<HHI")
    acl = (struct.pack("<I", 2) + entry.pack(1, 7, 2**32 - 1)  # version; ACL_USER_OBJ
           + b"".join(entry.pack(2, 7, 1000 + u) for u in range(8187))  # ACL_USER, one per uid
           + entry.pack(4, 7, 2**32 - 1) + entry.pack(0x10, 7, 2**32 - 1) + entry.pack(0x20, 7, 2**32 - 1))
    files = pinned = 0
    end = time.time() + seconds
    while time.time() < end:
        try:
            open(f"f{files}", "w").close()
        except OSError:
            break
        for name, value in (("system.posix_acl_access", acl), ("user.pin", b"x" * 65536)):
            try:
                os.setxattr(f"f{files}", name, value)
                pinned += len(value)
            except OSError:
                pass
        files += 1
    print(files, pinned, flush=True)
    time.sleep(hold)


def unreclaimable() -> int:
    """The host's unreclaimable kernel memory (SUnreclaim), bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("SUnreclaim:"))


def test_kernel_memory_is_bounded_per_sandbox(clean_machine):
    """A sandbox that pins what it can (ACLs, xattrs, files) grows the host's unreclaimable memory by less
    than 256 MiB, and a sibling's canonical answers, scored meanwhile, still pass."""
    from data.reward_cases import code_cases

    before, hog = unreclaimable(), {}
    thread = threading.Thread(target=lambda: hog.update(out=sandbox.run_sandboxed(ship(kernel_hog, 2.5, 2.0))[1]))
    thread.start()
    responses, tests = code_cases("humaneval")
    scores = compute_rewards(responses[:6], tests[:6], ["code"] * 6, num_workers=1)
    peak = before
    while thread.is_alive():
        peak = max(peak, unreclaimable())
        time.sleep(0.05)
    files, pinned = map(int, hog["out"].split())
    assert scores == [1.0] * 6
    assert pinned == 0 and 1000 < files <= sandbox.CODE_MAX_FILES, (files, pinned)
    assert peak - before < 256 << 20, (before >> 20, peak >> 20)


@as_root
def test_a_sandboxed_program_has_no_proc():
    """/proc/sys/fs/inode-nr and file-nr move with other sandboxes' files, /proc/vmstat with their memory,
    /proc/loadavg with their threads, /proc/self/smaps with who else maps a page: a sandboxed program has no /proc
    (limit.hide_proc). /dev/stdin and /dev/stdout, which stdio solutions open, are the case's own files there."""
    program = "import os\nprint(os.path.exists('/proc'), os.listdir('/proc'))"
    assert os.path.exists("/proc/sys/fs/inode-nr") and os.path.exists("/proc/vmstat")
    assert sandbox.run_sandboxed(program, timeout=10)[1] == "True []\n"
    program = "print(open('/dev/stdin').read().split())\nopen('/dev/stdout', 'w').write('then\\n')\nprint('last')"
    assert sandbox.run_sandboxed(program, "3 4\n", timeout=10)[1] == "then\n['3', '4']\nlast\n"


DEVICE_METADATA = """
import os


def fails(change, path):
    try:
        change(path)
    except OSError:
        return True
    return False


nodes = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
changes = {"utime now": lambda p: os.utime(p), "utime set": lambda p: os.utime(p, ns=(1, 1)),
           "chmod": lambda p: os.chmod(p, 0o666), "chown": lambda p: os.chown(p, os.getuid(), os.getgid()),
           "setxattr": lambda p: os.setxattr(p, "user.mark", b"1"), "link": lambda p: os.link(p, p + ".2"),
           "rename": lambda p: os.rename(p, p + ".2"), "unlink": lambda p: os.unlink(p)}
made = [f"{name} {p}" for p in nodes for name, change in changes.items() if not fails(change, p)]
full = os.open("/dev/full", os.O_WRONLY)
full = fails(lambda fd: os.write(fd, b"x"), full)  # ENOSPC: the device's own answer
print(made, open("/dev/null", "w").write("data"), len(open("/dev/zero", "rb").read(8)),
      len(open("/dev/urandom", "rb").read(8)), full)
"""


@as_root  # unprivileged, the sandbox cannot remount them (the start-up warning's mode)
def test_no_sandbox_can_change_the_metadata_of_a_device_node_it_shares():
    """The device nodes are the host's inodes, bound in: a change of their times, mode, owner or extended
    attributes would be seen by every other sandbox (one stamped its results into /dev/null's mtime, and copiers
    read them). Every such change is refused, and the nodes still read and write their data."""
    before = [os.stat(f"/dev/{n}") for n in ("null", "zero", "full", "random", "urandom")]
    out = sandbox.run_sandboxed(DEVICE_METADATA, timeout=20)[1]
    assert out == "[] 4 8 8 True\n", out
    after = [os.stat(f"/dev/{n}") for n in ("null", "zero", "full", "random", "urandom")]
    assert [(s.st_mtime_ns, s.st_ctime_ns, s.st_mode) for s in after] == \
        [(s.st_mtime_ns, s.st_ctime_ns, s.st_mode) for s in before]


# -- what one sandbox holds, all its processes together --------------------------------------------------
# Six children touching 1 GiB each: per-process limits alone let it hold 6 GiB of the host.
GREEDY = ("```python\nimport os, time\nfor _ in range(6):\n    if os.fork() == 0:\n"
          "        block = b'x' * (1 << 30)\n        time.sleep(30)\n        os._exit(0)\n"
          "def add(a, b):\n    return a + b\ntime.sleep(8)\n```")
ADD = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"}
RIGHT, WRONG = "```python\ndef add(a, b):\n    return a + b\n```", "```python\ndef add(a, b):\n    return a - b\n```"


def available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))


def least_available_while(fn) -> tuple[object, int]:
    """fn()'s result and how far the host's MemAvailable fell below its start meanwhile (bytes)."""
    start, low, done = available(), [available()], threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            low.append(available())

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
    return result, start - min(low)


@pytest.mark.slow
def test_a_greedy_response_holds_its_budget_at_most_and_scores_nothing(clean_machine):
    """Six children of 1 GiB each: the sandbox holds at most CODE_MEMORY_BYTES of the host (and some slack
    for the scorer's other sandboxes), scores 0 though its function is right, and its siblings score as they
    would alone."""
    if available() < 8 << 30:
        pytest.skip("the unbounded case needs 6 GiB free to show")
    scores, held = least_available_while(lambda: compute_rewards(
        [GREEDY, RIGHT, WRONG, RIGHT], [ADD] * 4, ["code"] * 4, num_workers=4, code_timeout=4))
    assert scores == [0.0, 1.0, 0.0, 1.0]
    assert held < sandbox.CODE_MEMORY_BYTES + (512 << 20), held >> 20


def test_the_watchdog_bounds_it_where_no_cgroup_can(probed, monkeypatch):
    """The fallback without cgroups: the watchdog kills the sandbox once its processes together pass the
    budget. It polls, from a thread that the six children compete with for the cores, so the bound has
    slack: up to 1 GiB over it here, where the same program with no bound held 4.8 GiB."""
    monkeypatch.setattr(sandbox, "_bound", ("watchdog", None))
    program = GREEDY.removeprefix("```python\n").removesuffix("```") + "print(add(2, 3))\n"
    (rc, out, _), held = least_available_while(lambda: sandbox.run_sandboxed(program, timeout=10))
    assert (rc, out) == (-9, "")
    assert held < sandbox.CODE_MEMORY_BYTES + (1 << 30), held >> 20
    assert sandbox.run_sandboxed("print(2 + 3)", timeout=10)[:2] == (0, "5\n")  # within it, as before


def test_a_sandbox_dies_first_when_the_host_runs_short():
    """Every process of a sandbox, its program's children too, is the host OOM killer's first choice (read here, in
    the host's /proc: the program has none)."""
    program = "import os, time\nif os.fork() == 0:\n    time.sleep(5)\n    os._exit(0)\ntime.sleep(5)\n"
    with sandbox._sandbox({"main.py": program}, "case_runner", 10, {"timeout": 10, "cap": 64}, data=[""]) as proc:
        deadline = time.monotonic() + 5
        while len(pids := sandbox._sandbox_tree(proc.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # bubblewrap and its init, the runner, the case, its child
        scores = {}
        for pid in pids:
            with open(f"/proc/{pid}/comm") as f, open(f"/proc/{pid}/oom_score_adj") as g:
                if f.read().strip() != "bwrap":
                    scores[pid] = g.read().strip()
    assert len(scores) == 3 and set(scores.values()) == {"1000"}, scores


@as_root
def test_the_hosts_proc_refuses_scoring_only_where_the_scorer_could_have_mounted_its_own(monkeypatch, caplog):
    """/proc left in view (HIDE_PROC off stands for a refused unmount): a scorer that mounts (root with
    CAP_SYS_ADMIN) refuses code rewards in one line; one that cannot (unprivileged, or a container without the
    capability, where bubblewrap's tmpfs is used too) goes on and warns."""
    monkeypatch.setattr(sandbox, "HIDE_PROC", False)
    with pytest.raises(sandbox.SandboxUnavailable, match="the host's /proc in view"):
        sandbox._probe_bwrap()
    monkeypatch.setattr(sandbox, "_can_mount", False)
    sandbox._probe_bwrap()
    assert "sandboxes see the host's /proc" in caplog.text


@as_root
@pytest.mark.parametrize("hierarchy", ["shadowed", "read-only"])
def test_a_cgroup_hierarchy_that_cannot_bound_falls_back_to_the_watchdog(hierarchy, tmp_path, monkeypatch):
    """A tmpfs mounted over the hierarchy (directories without the kernel's cgroup.procs, whose limits would be
    plain files) or a read-only one: the watchdog bounds the sandbox, the start-up line says why, and scores go
    on (they failed in one line each)."""
    where = str(tmp_path) if hierarchy == "shadowed" else "/proc/1"
    monkeypatch.setattr(sandbox, "_own_cgroup", lambda version, controller="memory": where)
    sandbox._memory_bound()
    monkeypatch.setattr(sandbox, "_cpu", sandbox._cpu)  # both restored after the test
    monkeypatch.setattr(sandbox, "_bound", None)
    assert sandbox._memory_bound() == ("watchdog", None) and sandbox._cpu is None
    assert "read-only, shadowed or not mounted" in sandbox.bound_line("bwrap")
    assert sandbox.run_sandboxed("print(6 * 7)", timeout=10)[1].strip() == "42"
    assert not list(tmp_path.rglob("trial-*"))  # its trial cgroup removed


def test_the_start_up_line_names_the_bound():
    line = subprocess.run([sys.executable, "-c", "from sandboxed import sandbox; sandbox.sandbox_mode()"], cwd=ROOT,
                          capture_output=True, text=True).stderr
    kind, _ = sandbox._memory_bound()
    assert line.count("\n") == 1 and f"at most {sandbox.CODE_MEMORY_BYTES >> 30} GiB" in line, line
    assert (f"cgroup v{kind[-1]}" if kind.startswith("cgroup") else "a watchdog") in line, line
    assert ("a copy of the interpreter" in line) == (os.geteuid() == 0), line


# -- the page cache by timing: a sandbox reads the files of its 1-bits, a later one times a read of each ---
TIMED = 'sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "encodings", "*.py")))[:64]'
CACHE_TIME_WRITER = f"import glob, os\nbits = {{bits!r}}\nfor path, bit in zip({TIMED}, bits):\n" \
                    "    if bit:\n        with open(path, 'rb') as f:\n            f.read()\n"
CACHE_TIME_READER = (f"import glob, os, time\ntimes = []\nfor path in {TIMED}:\n    fd = os.open(path, os.O_RDONLY)\n"
                     "    t = time.perf_counter_ns()\n    os.pread(fd, 4096, 0)\n"
                     "    times.append(time.perf_counter_ns() - t)\n    os.close(fd)\nprint(times)\n")


def timing_channel(rounds: int) -> float:
    """The share of bits a later sandbox decodes from read times, after the files were evicted on the host
    (as memory pressure would): a read faster than the geometric middle of the 10th and 90th percentile
    times is a 1."""
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    right = 0
    for _ in range(rounds):
        bits = [1] * 32 + [0] * 32
        secrets.SystemRandom().shuffle(bits)
        for where in (stdlib, (sandbox._sandbox_root() or "") + stdlib):
            for path in glob.glob(os.path.join(where, "encodings", "*.py")):
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # nothing, on the sandbox root's ramfs
                os.close(fd)
        sandbox.run_sandboxed(CACHE_TIME_WRITER.format(bits=bits), timeout=10)
        times = json.loads(sandbox.run_sandboxed(CACHE_TIME_READER, timeout=10)[1])
        q = sorted(times)
        cut = (q[6] * q[57]) ** 0.5
        right += sum((t < cut) == bit for t, bit in zip(times, bits))
    return right / (64 * rounds)


@as_root
def test_read_times_tell_a_later_sandbox_nothing():
    assert timing_channel(rounds=4) < 0.65  # chance is 0.5; 256 bits at chance pass 0.65 once in 10**6


@as_root
def test_read_times_carry_bits_through_the_hosts_files(probed, monkeypatch):
    monkeypatch.setattr(sandbox, "_root", False)  # the host's directories bound, as unprivileged
    assert timing_channel(rounds=2) > 0.9
