"""No channel and no shared limit between sandboxes (issue #27).

A response must be scored alone: nothing it leaves behind may reach a later sandbox, nothing it
does may reach one running beside it, and what it holds (processes, disk) must not cut what
another gets. The probes below try every channel a program has: the kernel keyring, SysV shared
memory, message queues and semaphores, POSIX message queues and shared memory, files in every
writable place, abstract Unix sockets and process names. Each probe is shown to carry its value
inside one sandbox (or, for the keyring, with the seccomp filter taken away), so a test that finds
nothing across sandboxes could have found something.
"""

import json
import os
import secrets
import shutil
import threading
import time

import pytest
from conftest import BENCHMARKS

import rewards
from data.prepare import load_rows
from rewards import compute_rewards

pytestmark = pytest.mark.skipif(not shutil.which("bwrap"), reason="bubblewrap's isolation is what is tested")
# As root every sandbox has a uid of its own, and the controls give them all one (the sandbox before issue #27).
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
    try:
        got = fn()
    except Exception:
        return
    if got and VALUE.encode()[-3:] in (got if isinstance(got, bytes) else str(got).encode()):
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

# What one sandbox can pass to itself (written, then read back in the same sandbox): the probes work.
WITHIN_ONE_SANDBOX = {"sysv-shm", "sysv-msg", "sysv-sem", "posix-mq", "abstract-socket", "process-name", "file"}


def numbers() -> dict:
    return {name: rewards._syscall_number(name) for name in ("add_key", "keyctl")}


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
    _, out, _ = rewards.run_sandboxed(both, timeout=10)
    (_, sent), (_, found) = report(out, "sent"), report(out, "found")
    assert not any(name.startswith("keyring") for name in sent), sent  # refused, even to itself
    assert {"file:/tmp", "file:/sandbox"} <= sent and not sent & {"file:/dev/shm", "file:/var/tmp", "file:/"}, sent
    assert found >= WITHIN_ONE_SANDBOX, found


def test_nothing_reaches_a_later_sandbox():
    value, tag = fresh()
    _, out_w, _ = rewards.run_sandboxed(writer(value, tag), timeout=10)
    _, out_r, _ = rewards.run_sandboxed(reader(value, tag), timeout=10)
    assert report(out_w, "sent")[1] >= {"sysv-shm", "posix-mq", "file:/tmp"}, out_w
    assert report(out_r, "found")[1] == set(), out_r


def test_nothing_reaches_a_sandbox_running_beside_it():
    value, tag = fresh()
    outs = {}

    def run(name: str, program: str) -> None:
        outs[name] = rewards.run_sandboxed(program, timeout=10)[1]

    held = threading.Thread(target=run, args=("writer", writer(value, tag, hold=4.0)))
    held.start()
    time.sleep(1.0)  # the writer has written and holds its processes, sockets and names
    run("reader", reader(value, tag))
    held.join()
    (uid_w, sent), (uid_r, found) = report(outs["writer"], "sent"), report(outs["reader"], "found")
    assert {"abstract-socket", "process-name", "sysv-shm"} <= sent, outs["writer"]
    assert found == set(), outs["reader"]
    assert os.geteuid() != 0 or (uid_w != uid_r and {uid_w, uid_r} <= set(rewards.SANDBOX_UIDS))


@as_root
def test_the_keyring_carries_values_without_the_filter(monkeypatch):
    """The control: one uid for every sandbox and no seccomp filter (the sandbox before issue #27), and
    the keyring carries the value to a later sandbox. The reader empties the keyrings it used."""
    monkeypatch.setattr(rewards, "REFUSED_SYSCALLS", ())
    one = rewards.SANDBOX_UIDS.start + secrets.randbelow(len(rewards.SANDBOX_UIDS))
    monkeypatch.setattr(rewards, "SANDBOX_UIDS", range(one, one + 1))
    value, tag = fresh()
    _, out_w, _ = rewards.run_sandboxed(writer(value, tag), timeout=10)
    _, out_r, _ = rewards.run_sandboxed(reader(value, tag, clear=True), timeout=10)
    assert {"keyring:user", "keyring:user-session"} <= report(out_w, "sent")[1], out_w
    assert {"keyring:user", "keyring:user-session"} <= report(out_r, "found")[1], out_r


def test_the_start_up_probe_fails_closed_without_the_filter(monkeypatch):
    monkeypatch.setattr(rewards, "REFUSED_SYSCALLS", ())
    monkeypatch.setattr(rewards, "_sandbox_mode", None)
    with pytest.raises(rewards.SandboxUnavailable, match="keyring reachable"):
        rewards.sandbox_mode()


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
    library falls back to clone), fork and subprocesses work; without the filter's namespace rules the
    program mounts a tmpfs of its own and writes four times its disk bound into memory."""
    out = rewards.run_sandboxed(OWN_NAMESPACE, timeout=10)[1]
    assert out.split() == ["unshare", "-1", "1"], out  # EPERM
    clone = rewards._syscall_number("clone")
    works = ("import ctypes, os, subprocess, sys, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             f"print(libc.syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())\n"
             "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
             "print(subprocess.run([sys.executable, '-c', 'print(5)'], capture_output=True, text=True).stdout.strip())")
    assert rewards.run_sandboxed(works, timeout=10)[1].split() == ["-1", "1", "thread", "5"]
    monkeypatch.setattr(rewards, "REFUSED_SYSCALLS", ("add_key", "keyctl", "request_key"))
    out = rewards.run_sandboxed(OWN_NAMESPACE, timeout=10)[1]
    assert int(out.split("wrote")[1]) == 256 << 20 > 4 * rewards.CODE_MAX_DISK_BYTES - 1, out


@as_root
def test_running_sandboxes_never_share_a_uid():
    with rewards._sandbox_uid("bwrap") as a, rewards._sandbox_uid("bwrap") as b:
        assert a != b and {a, b} <= set(rewards.SANDBOX_UIDS)
    # a uid given back can be claimed again
    with rewards._sandbox_uid("bwrap") as c:
        name = f"\0balanced-grpo-sandbox-uid-{c}"
        probe = rewards.socket.socket(rewards.socket.AF_UNIX, rewards.socket.SOCK_DGRAM)
        with pytest.raises(OSError):
            probe.bind(name)  # held while the sandbox runs
    probe.bind(name)
    probe.close()


# -- the attacks of issue #27, on real problems ----------------------------------------------------

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
def test_the_copier_wins_without_the_filter(monkeypatch):
    """The control, in this process: one uid, no filter; the copier then scores with its sibling."""
    monkeypatch.setattr(rewards, "REFUSED_SYSCALLS", ())
    one = rewards.SANDBOX_UIDS.start + secrets.randbelow(len(rewards.SANDBOX_UIDS))
    monkeypatch.setattr(rewards, "SANDBOX_UIDS", range(one, one + 1))
    responses, tests = copy_pairs(humaneval(COPIED), lcb_stdio(3), secrets.token_hex(4))
    try:
        scores = [rewards.score_code(r, t) for r, t in zip(responses, tests)]
    finally:
        rewards.run_sandboxed(reader("", "0" * 8, clear=True))
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
def test_the_oracle_learns_without_the_filter(monkeypatch):
    monkeypatch.setattr(rewards, "REFUSED_SYSCALLS", ())
    one = rewards.SANDBOX_UIDS.start + secrets.randbelow(len(rewards.SANDBOX_UIDS))
    monkeypatch.setattr(rewards, "SANDBOX_UIDS", range(one, one + 1))
    try:
        per_round = oracle_rounds(rewards.score_code)
    finally:
        rewards.run_sandboxed(reader("", "0" * 8, clear=True))
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


def test_a_neighbour_holding_its_processes_takes_none_from_the_others():
    hog = {}
    thread = threading.Thread(target=lambda: hog.update(out=rewards.run_sandboxed(HOG, timeout=10)[1]))
    thread.start()
    time.sleep(0.5)
    tests = {"stdio": [{"input": "100\n", "output": str(sum(i * i for i in range(100)))}]}
    scores = compute_rewards([THREADED] * 8, [tests] * 8, ["code"] * 8, num_workers=8)
    thread.join()
    held = hog["out"].split()
    assert held[0] == "held" and int(held[1]) >= rewards.CODE_MAX_PROCS - 4  # it reached its own limit
    assert scores == [1.0] * 8


# Writes 16 MiB files (the file-size limit) into every writable place it has, until none takes more.
DISK = ("total, dirs, i = 0, ['.', '/tmp'], 0\nwhile dirs and i < 64:\n    d = dirs[i % len(dirs)]\n    try:\n"
        "        with open(f'{d}/f{i}', 'wb') as f:\n            for _ in range(16):\n"
        "                f.write(b'x' * (1 << 20))\n                total += 1 << 20\n    except OSError:\n"
        "        dirs.remove(d)\n    i += 1\nprint(total)")


def test_disk_use_is_bounded_per_sandbox():
    t0 = time.time()
    rc, out, _ = rewards.run_sandboxed(DISK, timeout=10)
    written = int(out.split()[0])
    assert rewards.CODE_MAX_DISK_BYTES - (16 << 20) <= written <= rewards.CODE_MAX_DISK_BYTES
    assert time.time() - t0 < 5
