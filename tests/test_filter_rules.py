"""Every rule of the sandbox's seccomp filter is held by a test.

PROBES is the catalogue of what a sandbox must be refused, written here apart from rewards' rule table: one
system call per rule, with arguments the kernel itself would answer otherwise (success, or another errno).
For each probe: the sandbox gets its rule's errno under the whole filter, and does not get it under the
filter less that one rule, so no other rule (or the kernel) hides a missing one. A rule dropped from the
table fails its probe's first test; a rule added without a probe fails the catalogue's test.
"""

import errno
import inspect
import json
import shutil

import pytest

from sandboxed import sandbox

pytestmark = pytest.mark.skipif(not shutil.which("bwrap"), reason="the filter is bubblewrap's")

BAD_FD = -1
PAGE = "page"  # the address of a shared page the probe maps
CHILD = "child"  # as the first argument: the call is made in a forked child
# (system call, the rule's value or None, errno, arguments)
PROBES = [
    # the kernel keyring: a key type that does not exist, an unknown keyctl command, a key nobody has
    ("add_key", None, errno.EPERM, [b"no-such-type", b"probe", b"x", 1, -4]),
    ("keyctl", None, errno.EPERM, [9999, 0, 0, 0, 0]),
    ("request_key", None, errno.EPERM, [b"user", b"no-such-key", 0, 0]),
    # namespaces: unshare(0) succeeds, setns on no descriptor, clone3 with no arguments
    ("unshare", None, errno.EPERM, [0]),
    ("setns", None, errno.EPERM, [BAD_FD, 0]),
    ("clone3", None, errno.ENOSYS, [0, 0]),
    # clone with a CLONE_NEW* flag and CLONE_SIGHAND without CLONE_VM: the kernel's EINVAL, before any process
    *(("clone", flag, errno.EPERM, [flag | 0x800, 0, 0, 0, 0]) for flag in
      (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)),
    # locks, leases and dnotify, on no descriptor (EBADF from the kernel)
    ("flock", None, errno.ENOLCK, [BAD_FD, 1]),
    *(("fcntl", cmd, errno.ENOLCK, [BAD_FD, cmd, 0]) for cmd in
      (5, 6, 7, 12, 13, 14, 36, 37, 38)),  # F_GETLK, F_SETLK, F_SETLKW, F_*LK64, F_OFD_GETLK/SETLK/SETLKW
    *(("fcntl", cmd, errno.EINVAL, [BAD_FD, cmd, 0]) for cmd in (1024, 1025, 1026)),  # leases, F_NOTIFY
    ("fcntl", 1 << 32, errno.EINVAL, [BAD_FD, (1 << 32) | 1, 0]),  # F_GETFD with a high bit the kernel drops
    # watches: inotify_init succeeds, a watch on no descriptor; unprivileged fanotify with file ids
    ("inotify_init", None, errno.ENOSYS, []),
    ("inotify_init1", None, errno.ENOSYS, [0]),
    ("inotify_add_watch", None, errno.EPERM, [BAD_FD, b"/", 1]),
    ("fanotify_init", None, errno.EPERM, [0x200, 0]),
    # the page cache: advice, read-ahead and probes on no descriptor, mincore of an unaligned address
    ("fadvise64", None, errno.EPERM, [BAD_FD, 0, 0, 4]),
    ("readahead", None, errno.EPERM, [BAD_FD, 0, 4096]),
    ("mincore", None, errno.EPERM, [1, 4096, 0]),
    ("cachestat", None, errno.ENOSYS, [BAD_FD, 0, 0, 0]),
    ("preadv2", None, errno.ENOSYS, [BAD_FD, 0, 0, 0, 0, 0]),
    ("pwritev2", None, errno.ENOSYS, [BAD_FD, 0, 0, 0, 0, 0]),
    ("process_madvise", None, errno.ENOSYS, [BAD_FD, 0, 0, 0, 0]),
    ("io_uring_setup", None, errno.ENOSYS, [0, 0]),
    ("io_setup", None, errno.ENOSYS, [0, 0]),
    ("io_submit", None, errno.ENOSYS, [0, 0, 0]),
    # madvise on a page of its own, which the kernel would take: WILLNEED, REMOVE, MERGEABLE, COLD (>= 20)
    *(("madvise", advice, errno.EINVAL, [PAGE, 4096, advice]) for advice in (3, 9, 12)),
    ("madvise", 20, errno.EINVAL, [PAGE, 4096, 20]),
    # extended attributes: on a path that does not exist, on no descriptor
    ("setxattr", None, errno.EOPNOTSUPP, [b"/no-such-file", b"user.x", b"x", 1, 0]),
    ("lsetxattr", None, errno.EOPNOTSUPP, [b"/no-such-file", b"user.x", b"x", 1, 0]),
    ("fsetxattr", None, errno.EOPNOTSUPP, [BAD_FD, b"user.x", b"x", 1, 0]),
    ("setxattrat", None, errno.EOPNOTSUPP, [BAD_FD, b"x", 0, b"user.x", 0, 0]),
    # what the kernel numbers from a host-wide counter: an AF_UNIX socket and socketpair, a pipe (its two
    # descriptors into a page of its own), a memfd, a secret memory area, a message queue of its own IPC namespace,
    # a pidfd of the sandbox's init, one of no descriptor, a user-mode userfaultfd, clone with CLONE_PIDFD (and
    # CLONE_SIGHAND without CLONE_VM: the kernel's EINVAL)
    ("socket", None, errno.EAFNOSUPPORT, [1, 1, 0]),
    ("socketpair", None, errno.EAFNOSUPPORT, [1, 1, 0, PAGE]),
    ("pipe", None, errno.EPERM, [PAGE]),
    ("pipe2", None, errno.EPERM, [PAGE, 0]),
    ("memfd_create", None, errno.EPERM, [b"probe", 0]),
    ("memfd_secret", None, errno.EPERM, [0]),
    ("mq_open", None, errno.EPERM, [b"probe", 0o102, 0o600, 0]),
    ("pidfd_open", None, errno.EPERM, [1, 0]),
    ("pidfd_getfd", None, errno.EPERM, [BAD_FD, 0, 0]),
    ("userfaultfd", None, errno.EPERM, [1]),
    ("clone", 0x1000, errno.EPERM, [0x1000 | 0x800, 0, 0, 0, 0]),
    # a perf event and a BPF map of attributes at a bad address (EFAULT, or EPERM where unprivileged BPF is off)
    ("perf_event_open", None, errno.ENOSYS, [1, 0, -1, -1, 0]),
    ("bpf", None, errno.ENOSYS, [0, 1, 72]),
    # the host's counters: sysinfo into a page of its own; a cookie of no descriptor (EBADF from the kernel)
    ("sysinfo", None, errno.ENOSYS, [PAGE]),
    ("setsid", None, errno.EPERM, [CHILD]),  # in a child, not its group's leader (the program leads bubblewrap's)
    *(("getsockopt", option, errno.ENOPROTOOPT, [BAD_FD, 1, option, PAGE, PAGE]) for option in (57, 71)),
]

def probe(calls: list) -> None:
    """In the sandbox: runs each [number, arguments] given and prints what each got: 0 where the call
    succeeded, else its errno ("page": the address of a shared page of its own)."""
    import ctypes
    import json
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    page = mmap.mmap(-1, 4096, mmap.MAP_SHARED)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    got = []
    for nr, args in calls:
        child = args[:1] == ["child"]
        args = [address if a == "page" else a.encode("latin-1") if isinstance(a, str) else ctypes.c_long(a)
                for a in args[child:]]
        if child:
            import os

            pid = os.fork()
            if pid == 0:
                ctypes.set_errno(0)
                os._exit(0 if libc.syscall(ctypes.c_long(nr), *args) >= 0 else ctypes.get_errno())
            got.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
            continue
        ctypes.set_errno(0)
        got.append(0 if libc.syscall(ctypes.c_long(nr), *args) >= 0 else ctypes.get_errno())
    print(json.dumps(got))


def label(probe: tuple) -> str:
    name, value, _, _ = probe
    return name if value is None else f"{name}:{value:#x}"


def rule_key(rule: tuple) -> tuple:
    name, _, cmp = rule
    return name, None if cmp is None else cmp[2]


def run_probes(probes: list) -> list[int]:
    calls = [[sandbox._syscall_number(name),
              [a.decode("latin-1") if isinstance(a, bytes) else a for a in args]] for name, _, _, args in probes]
    _, out, _ = sandbox.run_sandboxed(f"{inspect.getsource(probe)}\nprobe({calls!r})\n", timeout=10)
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def under_the_whole_filter() -> list[int]:
    sandbox.sandbox_mode()
    return run_probes(PROBES)


def test_every_rule_has_a_probe_and_every_probe_a_rule():
    rules = [rule_key(rule) for rule in sandbox.seccomp_rules()]
    assert len(rules) == len(set(rules)), "a rule appears twice"
    assert set(rules) == {(name, value) for name, value, _, _ in PROBES}


@pytest.mark.parametrize("k", range(len(PROBES)), ids=[label(p) for p in PROBES])
def test_the_filter_refuses_it(k, under_the_whole_filter):
    assert under_the_whole_filter[k] == PROBES[k][2], errno.errorcode.get(under_the_whole_filter[k])


@pytest.mark.parametrize("k", range(len(PROBES)), ids=[label(p) for p in PROBES])
def test_its_rule_alone_refuses_it(k, under_the_whole_filter, monkeypatch):
    """The filter less this probe's rule lets the call through to the kernel, which answers otherwise: the
    test above fails when the rule goes."""
    name, value, code, _ = PROBES[k]
    rules = sandbox.seccomp_rules()
    monkeypatch.setattr(sandbox, "seccomp_rules", lambda: tuple(r for r in rules if rule_key(r) != (name, value)))
    got = run_probes([PROBES[k]])[0]
    assert got != code, f"{label(PROBES[k])} still gets {errno.errorcode[code]} without its rule"
