"""The sandbox that runs model-written code, for rewards.py's code rewards.

Model-written code is untrusted. It runs under bubblewrap (`apt-get install bubblewrap`):
without network, in its own PID namespace, with only the system's and Python's directories
visible (read-only), in a fresh temporary directory, with a minimal environment, as an
unprivileged user, under limits on CPU time, wall time, memory, processes, open files, file
size and the output read back (CODE_MAX_OUTPUT_BYTES), its whole process group killed at the
deadline. Without bubblewrap, code rewards refuse to run (fail closed) unless a weaker mode is
chosen explicitly with REWARDS_SANDBOX=unshare (no network, own PID namespace, but the whole
filesystem writable by `nobody`) or REWARDS_SANDBOX=rlimits (resource limits only).

    run_cases(program, inputs) -> (exit code, stdout, timed out) per input, all in one sandbox start
    call_server(code, prelude, entry) -> the scorer's side of a function test's call server
    sandbox_mode() -> the isolation in force, checked once by a probe sandbox (fails closed)

The programs that run inside (the stdio case runner, the call server, the start-up probe) are this
folder's other files; bubblewrap shows them read-only at /prog.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import errno
import functools
import json
import logging
import marshal
import math
import os
import queue
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sandboxed.plain import decode_plain, encode_plain  # the call server's encoding, both ways

log = logging.getLogger("rewards")

# The programs run in the sandbox (the stdio case runner, the call server, the start-up probe), real files;
# bubblewrap binds this folder read-only at /prog.
SANDBOXED = Path(__file__).resolve().parent


CODE_TIMEOUT_S = 10.0  # wall clock per test program
CODE_MEMORY_BYTES = 2 << 30
CODE_MAX_PROCS = 64
CODE_MAX_FILE_BYTES = 16 << 20
CODE_MAX_OUTPUT_BYTES = 4 << 20  # stdout read back from a program; past it the program is killed
CODE_MAX_DISK_BYTES = 64 << 20  # the sandbox's writable directory, all files together (a tmpfs of its own)
# Files (and directories, links) in it: each is kernel memory outside the size bound, ~1.3 KiB, so this
# bounds them to ~25 MiB (unbounded, one sandbox made 637,000 empty files, 794 MiB, in 7 s).
CODE_MAX_FILES = 16384
# As root, each sandbox runs its code as a uid no other running sandbox on the machine has, so that what
# the kernel counts per uid (RLIMIT_NPROC's processes, pipe and inotify quotas) is counted per sandbox.
# The range lies above sssd's default id mapping (200000-2000200000) and below 2**31; move it with
# REWARDS_SANDBOX_UID_BASE where it is taken.
_UID_BASE = int(os.environ.get("REWARDS_SANDBOX_UID_BASE", 0x7E000000))
SANDBOX_UIDS = range(_UID_BASE, _UID_BASE + 65536)
# System calls every sandbox is refused (EPERM), as Docker's and Podman's default seccomp profiles refuse
# them: the kernel keyring, which is not namespaced (a key outlives the sandbox that added it and would carry
# values from one response to another); and namespaces of its own (unshare, setns, and clone with a
# CLONE_NEW* flag, see seccomp_rules), the way to a user namespace where the program is root: a tmpfs it
# mounts there is memory outside every limit, and user namespaces are much of the kernel's attack surface.
REFUSED_SYSCALLS = ("add_key", "keyctl", "request_key", "unshare", "setns")
# What sandboxes share is the host kernel's state of the files every one of them reads (the interpreter's,
# the system's): one sandbox could set it and another read it. Each rule is (system call,
# errno, None or (argument, ">=" or "==", value)); see seccomp_rules.
_LOCK_CMDS = (5, 6, 7, 12, 13, 14, 36, 37, 38)  # F_GETLK, F_SETLK, F_SETLKW, their *64 and F_OFD_* forms
_WATCH_CMDS = (1024, 1025, 1026)  # F_SETLEASE, F_GETLEASE, F_NOTIFY
SHARED_STATE_RULES = (
    # Locks need only a read-only descriptor and are seen by every process of the machine (F_GETLK, a
    # refused flock): ENOLCK, the answer where the kernel keeps no locks (e.g. NFS without lockd).
    ("flock", errno.ENOLCK, None),
    *(("fcntl", errno.ENOLCK, (1, "==", cmd)) for cmd in _LOCK_CMDS),
    # A write lease is granted only if no one else has the file open; dnotify reports other processes'
    # reads in a directory: EINVAL, the kernel's own answer where leases or dnotify are disabled.
    *(("fcntl", errno.EINVAL, (1, "==", cmd)) for cmd in _WATCH_CMDS),
    ("fcntl", errno.EINVAL, (1, ">=", 1 << 32)),  # the kernel reads cmd's low 32 bits: no way around
    # inotify and fanotify watch inodes, so they report other sandboxes' opens and reads of shared files.
    ("inotify_init", errno.ENOSYS, None), ("inotify_init1", errno.ENOSYS, None),
    ("inotify_add_watch", errno.EPERM, None), ("fanotify_init", errno.EPERM, None),
    # The page cache of shared files: evicting a page (fadvise DONTNEED, madvise PAGEOUT/COLD), or telling
    # whether one is cached without loading it (mincore, cachestat, a no-wait read: RWF_NOWAIT through
    # preadv2/pwritev2, io_uring or Linux AIO). preadv2/pwritev2 answer ENOSYS: the C library then does a
    # flag-less call with preadv/pwritev. madvise's refused advice: WILLNEED, REMOVE, MERGEABLE (KSM's
    # merging is a timing channel between processes) and all from 20 on (COLD, PAGEOUT, POPULATE_*,
    # COLLAPSE, and any added later), EINVAL as from a kernel that does not know them; the 64-bit compare
    # refuses any value with high bits set, which the kernel would read as its low 32.
    ("fadvise64", errno.EPERM, None), ("readahead", errno.EPERM, None), ("mincore", errno.EPERM, None),
    ("cachestat", errno.ENOSYS, None), ("preadv2", errno.ENOSYS, None), ("pwritev2", errno.ENOSYS, None),
    ("process_madvise", errno.ENOSYS, None), ("io_uring_setup", errno.ENOSYS, None),
    ("io_setup", errno.ENOSYS, None), ("io_submit", errno.ENOSYS, None),
    *(("madvise", errno.EINVAL, (2, "==", advice)) for advice in (3, 9, 12)),
    ("madvise", errno.EINVAL, (2, ">=", 20)),
    # Extended attributes and ACLs are kernel memory outside the tmpfs's size (6 GiB pinned by one sandbox):
    # EOPNOTSUPP, as from a filesystem without them (shutil.copystat and cp skip them then).
    *((name, errno.EOPNOTSUPP, None) for name in ("setxattr", "lsetxattr", "fsetxattr", "setxattrat")),
    # Pipes, sockets and the other objects the kernel numbers from one counter for the whole host (their inodes:
    # pipefs, sockfs, shmem's internal mount, mqueue, secretmem; pidfs's from every process the host starts),
    # which any fstat of one reads and making one moves (tests/test_channel_scan.py found them a channel between
    # sandboxes). Nothing a response needs: the reference harnesses (human-eval's reliability_guard) take
    # subprocesses away too, and the sandbox has no network. Sockets of every family EAFNOSUPPORT, as for a family
    # the kernel lacks (an inet socket's buffers would also be charged to the host's tcp_mem); the rest
    # EPERM; clone with CLONE_PIDFD (0x1000) too. The case runner hands stdin and stdout as files of the
    # sandbox's own tmpfs instead (sandboxed/case_runner.py).
    ("socket", errno.EAFNOSUPPORT, None), ("socketpair", errno.EAFNOSUPPORT, None),
    *((name, errno.EPERM, None) for name in ("pipe", "pipe2", "memfd_create", "memfd_secret", "mq_open",
                                             "pidfd_open", "pidfd_getfd", "userfaultfd")),
    ("clone", errno.EPERM, (0, "&", 0x1000)),
    # Perf events and BPF objects are numbered from host-wide counters too (an event's id, read with
    # PERF_FORMAT_ID; a map's or program's id), and a perf event reads the CPU's own counters: ENOSYS, as from a
    # kernel built without them (Docker's default profile refuses both).
    ("perf_event_open", errno.ENOSYS, None), ("bpf", errno.ENOSYS, None),
    # The host's counters outside files, which tests/test_channel_scan.py found moving with another sandbox:
    # sysinfo (the host's free memory, load and process count: sysconf's _SC_AVPHYS_PAGES) ENOSYS, as on a
    # kernel without it; a socket's cookie (SO_COOKIE, 57, and SO_NETNS_COOKIE, 71, at any level: the kernel
    # numbers sockets and namespaces from counters every process moves) ENOPROTOOPT, as for an option the
    # kernel does not know.
    ("sysinfo", errno.ENOSYS, None),
    *(("getsockopt", errno.ENOPROTOOPT, (2, "==", option)) for option in (57, 71)),
    # A session of its own (setsid) makes a new autogroup, which the scheduler weighs like a whole login session
    # (three responses' setsid children starved a correct sibling where no cpu cgroup groups them) and numbers
    # from a host-wide counter every later sandbox reads in /proc/self/autogroup: EPERM, setsid's answer for a
    # process group leader. bubblewrap makes the sandbox's one session before the filter applies.
    ("setsid", errno.EPERM, None),
)
# System calls newer than some libseccomp releases know: since 424 every architecture numbers them alike.
_UNIFIED_SYSCALLS = {"cachestat": 451, "setxattrat": 463}
_CLONE_NEW = (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)  # CLONE_NEW*

# As root, a sandboxed program has no /proc (sandboxed/limit.py, hide_proc); tests/test_channel_scan.py's
# control turns that off. Nor can it change the metadata of the device nodes every sandbox shares (seal_devices).
HIDE_PROC = True
SEAL_DEVICES = True
_TMP_ROOT: str | None = None  # a worker's directory for the weaker modes' sandboxes (see _spawn)
_IN_WORKER = False  # a scoring worker: the start-up line is its parent's to print
SANDBOX_MODES = ("bwrap", "unshare", "rlimits")  # strongest first; the weaker two only on request
_sandbox_mode: str | None = None


class SandboxUnavailable(RuntimeError):
    """Code rewards cannot run with the isolation asked for (REWARDS_SANDBOX, default bwrap)."""


# Without root no sandbox can be kept from the others: each runs as the scorer's uid and shares its limits (one
# sandbox holding every POSIX timer the uid may have starves the scoring workers), reads the host's kernel counters
# through /proc (a relay from a solver to copiers), and no cgroup bounds its memory (System V shared memory,
# which no process maps, passes the watchdog's sum)
UNPRIVILEGED = ("code rewards without root cannot keep one response's sandbox from another's (they would share "
                "this user's limits and the host's kernel counters, and no cgroup would bound their memory: a "
                "response could copy another's result or deny its score, docs/rewards.md): run the scorer as root "
                "(in a container, with CAP_SYS_ADMIN and a writable cgroup), or set REWARDS_SANDBOX_UNPRIVILEGED=1 "
                "to score with that risk")


def sandbox_mode() -> str:
    """The isolation for untrusted code: bubblewrap, or a weaker mode chosen by REWARDS_SANDBOX.

    Fails closed: raises SandboxUnavailable, with a one-line reason and the fix, rather than
    run model-written code with the trainer's reach. Under bubblewrap, one probe sandbox must
    find the keyring and new namespaces refused and its directory writable before any response
    is scored.
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
            "isolation (docs/rewards.md)")
    if mode == "bwrap" and os.geteuid() != 0:
        if os.environ.get("REWARDS_SANDBOX_UNPRIVILEGED") != "1":
            raise SandboxUnavailable(UNPRIVILEGED)
        log.warning("REWARDS_SANDBOX_UNPRIVILEGED=1: sandboxes share this user's limits and the host's kernel "
                    "counters, and no cgroup bounds their memory together (docs/rewards.md)")
    if mode == "bwrap":
        _probe_bwrap()
    if mode == "unshare" and not (shutil.which("unshare") and _runs(_unshare_prefix() + [sys.executable, "-c", ""])):
        raise SandboxUnavailable("REWARDS_SANDBOX=unshare: `unshare --net --pid` does not work on this machine")
    if mode != "bwrap":
        log.warning("REWARDS_SANDBOX=%s: untrusted code runs without filesystem isolation%s, and sandboxes share "
                    "the kernel keyring", mode, "" if mode == "unshare" else ", network or PID namespace")
    _sandbox_mode = mode
    if not _IN_WORKER:
        print(f"rewards: {mode} sandboxes; {bound_line(mode)}", file=sys.stderr, flush=True)
    return mode


def bound_line(mode: str) -> str:
    """What bounds one sandbox's processes together, and what files it reads, in one line."""
    kind, _ = _memory_bound()
    budget = f"{CODE_MEMORY_BYTES / 2**30:g} GiB"
    if kind.startswith("cgroup"):
        cpu = "one CPU weight for all its processes" if _cpu else "CPU weighed per session (no cpu controller here)"
        line = f"each holds at most {budget} and {CODE_MAX_PROCS} processes in all, {cpu} (cgroup v{kind[-1]})"
    else:
        why = ("no writable cgroup hierarchy here: read-only, shadowed or not mounted" if os.geteuid() == 0 else
               "no writable cgroup here; run the scorer as root for a hard bound")
        line = (f"each holds at most about {budget} in all (a watchdog sums its resident memory every "
                f"{WATCHDOG_S * 1000:g} ms: {why})")
    if mode != "bwrap":
        return line
    if root := _sandbox_root():
        size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(root) for f in files)
        return line + f"; they read a copy of the interpreter and its libraries held in memory ({size >> 20} MiB)"
    return line + "; they read the host's files (not root: their page cache is shared, docs/rewards.md)"


def _probe_bwrap() -> None:
    """One sandbox as responses get it: it must start (bubblewrap 0.8 or newer, for the size-limited
    directory), find the keyring, new namespaces and file locks refused, and its own directory writable. It
    must have no /proc (limit.hide_proc) and device nodes whose metadata it cannot change (limit.seal_devices)
    where this scorer can mount (it mounted the probe's tmpfs); where it cannot (unprivileged, or a container
    without CAP_SYS_ADMIN) a warning says the host's /proc is seen."""
    try:
        with _sandbox({}, "probe", 10, {"add_key": _syscall_number("add_key"), "cgroup_name": _CGROUP_NAME,
                                        "probe": True},
                      talk=True, mode="bwrap") as proc:
            out, err = proc.communicate(timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        out, err = b"", str(e).encode()
    if out.strip() == b"isolated, the host's /proc in view" and not _can_mount:
        log.warning("sandboxes see the host's /proc (no mount here): its host-wide counters are readable "
                    "(docs/rewards.md)")
    elif out.strip() != b"isolated":
        why = next((line for line in err.decode(errors="replace").splitlines() if line.strip()), out.decode().strip())
        raise SandboxUnavailable(
            f"bubblewrap cannot start an isolated sandbox here ({why or 'no reply'}): it needs bubblewrap 0.8 or "
            "newer, unprivileged user namespaces if not run as root, and libseccomp; fix that, or set "
            "REWARDS_SANDBOX=unshare or rlimits to accept weaker isolation")


def _runs(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _bwrap_prefix(seccomp_fd: int, tmpfs: str | None = None) -> list[str]:
    # Only what a Python program needs is visible, read-only: the sandbox root's copy (_sandbox_root), else
    # the system's and the interpreter's directories; the project, checkpoints and home directories are not
    # there at all. The one writable place is a tmpfs of CODE_MAX_DISK_BYTES, the sandbox's own (/tmp points
    # into it): nothing on the host's disk, nothing another sandbox sees, gone with the sandbox. It is `tmpfs`
    # (_private_tmpfs, which bounds its files too) or, where that could not be mounted, bubblewrap's own.
    binds = []
    if root := _sandbox_root():
        for entry in sorted(os.listdir(root)):
            path = os.path.join(root, entry)
            binds += ["--symlink", os.readlink(path), "/" + entry] if os.path.islink(path) else \
                ["--ro-bind", path, "/" + entry]
    else:
        for d in ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc"):
            if os.path.exists(d):
                binds += ["--ro-bind", d, d]
        # The interpreter's installation goes to /py: its own parents (e.g. /root) may not be
        # traversable by the unprivileged user the program runs as.
        binds += ["--ro-bind", sys.base_prefix, "/py"]
        binds += ["--ro-bind", str(SANDBOXED), "/prog"]  # the programs this sandbox runs
    # The sandbox's root and /dev are tmpfs too, writable by the program where it runs unprivileged
    # (bubblewrap's user namespace makes it their owner): both read-only once set up.
    own = ["--bind", tmpfs, "/sandbox"] if tmpfs else ["--size", str(CODE_MAX_DISK_BYTES), "--perms", "1777",
                                                       "--tmpfs", "/sandbox"]
    # /proc is there for the sandbox's set-up only (sandboxed/limit.py unmounts it where it may); where it stays,
    # /proc/sys is not the host's (fs/inode-nr and file-nr move with other sandboxes' files): an empty one.
    # /dev holds the device nodes a program opens, and stdin and stdout as paths to the files the case runner
    # makes them (.io), not bubblewrap's links into /proc/self/fd.
    dev = [x for node in ("null", "zero", "full", "random", "urandom") for x in ("--dev-bind", f"/dev/{node}",
                                                                               f"/dev/{node}")]
    io = [x for name in ("stdin", "stdout") for x in ("--symlink", f"/sandbox/.io/{name}", f"/dev/{name}")]
    return ["bwrap", *binds, *own, "--symlink", "/sandbox", "/tmp", "--proc", "/proc", "--perms", "0555",
            "--tmpfs", "/proc/sys", "--remount-ro", "/proc/sys", "--perms", "0755", "--tmpfs", "/dev", *dev, *io,
            "--symlink", "null", "/dev/stderr", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/sandbox",
            "--unshare-net", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--die-with-parent", "--new-session", "--seccomp", str(seccomp_fd)]


def _sandbox_python(mode: str) -> str:
    exe = os.path.realpath(sys.executable)
    if mode == "bwrap" and not _sandbox_root():
        return os.path.join("/py", os.path.relpath(exe, sys.base_prefix))
    return exe


# The sandbox root. Files every sandbox reads are a channel between sandboxes if they are the host's: one
# sandbox reads a file (its pages come into the page cache), a later one times a read of it (a cached 4 KiB read
# took 19 us, an evicted one 134 us: 0.97 of the bits decoded). As root, sandboxes see instead a copy of what
# a Python program needs (the interpreter and its standard library at their own paths, the C libraries they
# load, ld.so.cache, the C.UTF-8 locale, sandboxed/) in a ramfs the scorer mounts once and shares with its
# workers: ramfs pages are never evicted nor swapped, so every read of it is a cached read, whatever any
# sandbox did. Third-party packages are not in it, whatever the host's interpreter has installed.
_STDLIB_LEFT_OUT = ("site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "config-*",
                    "_tkinter*", "*.opt-1.pyc", "*.opt-2.pyc")
_root: str | None | bool = None  # None: not tried yet; False: cannot mount (the host's directories then)
_root_claim: socket.socket | None = None


def _sandbox_root() -> str | None:
    """The directory holding the sandbox root (see above), made on first use; None where it cannot be mounted
    (unprivileged, or a container without CAP_SYS_ADMIN)."""
    global _root, _root_claim
    if _root is None:
        _root = False
        if os.geteuid() == 0:
            _root_claim = _claim_dir(f"root-{os.getpid()}")
            path = os.path.join(_TMPFS_ROOT, f"root-{os.getpid()}")
            os.makedirs(path, mode=0o755, exist_ok=True)
            if _libc().mount(b"ramfs", path.encode(), b"ramfs", 0x2 | 0x4, b"mode=0755") == 0:
                try:
                    _fill_root(path)
                    _libc().mount(b"ramfs", path.encode(), b"ramfs", 0x20 | 0x1 | 0x2 | 0x4, None)  # read-only
                    atexit.register(_unmount_dir, path)
                    _root = path
                except (OSError, subprocess.SubprocessError) as e:
                    log.warning("cannot copy the interpreter for sandboxes (%s): they read the host's files", e)
                    _unmount_dir(path)
            if not _root:
                _root_claim.close()
    return _root or None


def _fill_root(root: str) -> None:
    exe = os.path.realpath(sys.executable)
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    dynload = os.path.join(stdlib, "lib-dynload")
    modules = [os.path.join(dynload, f) for f in os.listdir(dynload) if f.endswith(".so")]
    ldd = shutil.which("ldd") or "/usr/bin/ldd"
    listed = subprocess.run([ldd, exe, *modules], capture_output=True, text=True, check=True).stdout
    libs = set(re.findall(r"(?m)(?:=> |^\s)(/\S+) \(0x", listed))
    for path in [exe, *libs, "/etc/ld.so.cache", "/usr/lib/locale/C.utf8"]:
        if os.path.exists(path):
            _copy_path(path, root)
    shutil.copytree(stdlib, root + stdlib, symlinks=True, ignore=shutil.ignore_patterns(*_STDLIB_LEFT_OUT))
    shutil.copytree(SANDBOXED, os.path.join(root, "prog"), ignore=shutil.ignore_patterns("__pycache__", "sandbox.py"))


def _copy_path(path: str, root: str) -> None:
    """Copy `path` into `root` at the same place, with the symbolic links met on the way (/lib -> usr/lib)."""
    parts = path.strip("/").split("/")
    for i in range(len(parts)):
        host = "/" + "/".join(parts[: i + 1])
        if os.path.islink(host):
            if not os.path.lexists(root + host):
                os.makedirs(os.path.dirname(root + host), exist_ok=True)
                os.symlink(os.readlink(host), root + host)
            target = os.path.join(os.path.dirname(host), os.readlink(host), *parts[i + 1:])
            return _copy_path(os.path.normpath(target), root)
    os.makedirs(os.path.dirname(root + path), exist_ok=True)
    if os.path.isdir(path):
        shutil.copytree(path, root + path, dirs_exist_ok=True)
    else:
        shutil.copy2(path, root + path)


@functools.cache
def _python_readable_by_others() -> bool:
    """Whether a uid other than ours can run the interpreter (every parent world-traversable)."""
    path = sys.base_prefix
    while path != os.path.dirname(path):
        if not os.stat(path).st_mode & 0o001:
            log.warning("%s is not readable by other users: untrusted code runs as root", path)
            return False
        path = os.path.dirname(path)
    return True


@contextlib.contextmanager
def _sandbox_uid(mode: str) -> Iterator[int]:
    """The uid one sandbox runs its untrusted code as: as root, one of SANDBOX_UIDS that no other
    running sandbox on this machine holds; -1 when the scorer is unprivileged (its own uid), or when
    a weaker mode's interpreter is unreadable by other users (root).

    Held by binding an abstract socket named after the uid, which the kernel frees when the sandbox is
    over or this process dies, however it dies. The search starts at a random place: a uid just
    given back (its processes may take a moment to go) is rarely the next one taken.
    """
    if os.geteuid() != 0 or (mode != "bwrap" and not _python_readable_by_others()):
        yield -1
        return
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        start = secrets.randbelow(len(SANDBOX_UIDS))
        for k in range(len(SANDBOX_UIDS)):
            uid = SANDBOX_UIDS[(start + k) % len(SANDBOX_UIDS)]
            try:
                claim.bind(f"\0balanced-grpo-sandbox-uid-{uid}")
            except OSError:  # another sandbox holds it
                continue
            yield uid
            return
        raise SandboxUnavailable(f"all {len(SANDBOX_UIDS)} sandbox uids are in use on this machine")
    finally:
        claim.close()


_TMPFS_ROOT = "/run/balanced-grpo-sandboxes" if os.path.isdir("/run") else os.path.join(tempfile.gettempdir(),
                                                                                        "balanced-grpo-sandboxes")
_can_mount: bool | None = None  # None: not tried yet


@contextlib.contextmanager
def _private_tmpfs(mode: str, uid: int) -> Iterator[str | None]:
    """As root, the writable directory of the sandbox holding `uid`: a tmpfs of CODE_MAX_DISK_BYTES and at
    most CODE_MAX_FILES files (bubblewrap cannot set nr_inodes), mounted here, bound into the sandbox and
    unmounted after it. None where it cannot be mounted (unprivileged, or a container without
    CAP_SYS_ADMIN): bubblewrap's own tmpfs then, whose file count only the kernel's default bounds (half
    the machine's pages). A dead scorer's leftover is unmounted by the next scorer to claim its directory,
    or when a worker is started (_sweep_tmpfs)."""
    global _can_mount
    if mode != "bwrap" or uid < 0 or _can_mount is False:
        yield None
        return
    try:
        claim = _claim_dir(str(uid), wait=CODE_TIMEOUT_S)
    except OSError:
        raise SandboxUnavailable(f"the sandbox directory {uid} is not given back") from None
    path = os.path.join(_TMPFS_ROOT, str(uid))
    os.makedirs(path, mode=0o700, exist_ok=True)
    _unmount(path)  # the directory is ours: whatever is mounted there is a dead scorer's
    options = f"size={CODE_MAX_DISK_BYTES},nr_inodes={CODE_MAX_FILES},mode=1777".encode()
    if _libc().mount(b"tmpfs", path.encode(), b"tmpfs", 0x2 | 0x4, options) != 0:  # MS_NOSUID | MS_NODEV
        _can_mount = False
        log.warning("cannot mount a tmpfs for sandboxes (%s): their file count is not bounded",
                    os.strerror(ctypes.get_errno()))
        claim.close()
        yield None
        return
    _can_mount = True
    try:
        yield path
    finally:
        _cleanups.put((functools.partial(_unmount_dir, path), claim))
        _start_cleaner()


def _claim_dir(name: str, wait: float = 0.0) -> socket.socket:
    """The directory's own claim (an abstract socket, as for uids), held from its mount to its unmount,
    which outlasts the sandbox: a sandbox given the same uid meanwhile waits for it, up to `wait` seconds
    (OSError past them)."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deadline = time.monotonic() + wait
    while True:
        try:
            claim.bind(f"\0balanced-grpo-sandbox-dir-{name}")
            return claim
        except OSError:
            if time.monotonic() >= deadline:
                claim.close()
                raise
            time.sleep(0.005)


# Unmounting waits out an RCU grace period (about 4 ms here, a sixth of a sandbox's start), and a cgroup is
# removed once its killed processes are gone: a thread of the scorer does both once the sandbox is over, off
# the scoring path. Each entry is (what to do, the claim released after it).
_cleanups: queue.SimpleQueue = queue.SimpleQueue()
_cleaner: threading.Thread | None = None
_cleaner_lock = threading.Lock()


def _start_cleaner() -> None:
    global _cleaner
    with _cleaner_lock:
        if _cleaner is None or not _cleaner.is_alive():
            _cleaner = threading.Thread(target=_clean_queued, name="sandbox-cleaner", daemon=True)
            _cleaner.start()


def _clean_queued(block: bool = True) -> None:
    while True:
        try:
            action, claim = _cleanups.get(block=block)
        except queue.Empty:
            return
        try:
            action()
        finally:
            claim.close()


atexit.register(_clean_queued, block=False)  # what the thread has not reached when the scorer ends


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _unmount(path: str) -> None:
    _libc().umount2(path.encode(), 2)  # MNT_DETACH; EINVAL where nothing is mounted


def _unmount_dir(path: str) -> None:
    _unmount(path)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _sweep_tmpfs() -> None:
    """Unmount the directories, and remove the cgroups, of sandboxes whose scorer died (their claims are gone
    with it)."""
    if os.geteuid() != 0:
        return
    leftovers = [(name, functools.partial(_unmount_dir, os.path.join(_TMPFS_ROOT, name)))
                 for name in (os.listdir(_TMPFS_ROOT) if os.path.isdir(_TMPFS_ROOT) else ())]
    kind, base = _memory_bound()
    if base is not None:
        bases = [base] + ([_cpu] if _cpu is not None and _cpu != base else [])
        leftovers += [("cgroup-" + name, functools.partial(_remove_cgroups, [os.path.join(b, name) for b in bases]))
                      for name in os.listdir(base) if name.isdigit()]
    for name, action in leftovers:
        try:
            claim = _claim_dir(name)
        except OSError:  # a live sandbox's, or one being cleaned up
            continue
        _cleanups.put((action, claim))
    _clean_queued(block=False)


# --- what one sandbox holds, all its processes together ----------------------------------------------------
#
# The per-process limits (CODE_MEMORY_BYTES of address space, CODE_MAX_PROCS processes) leave the sum open: six
# children touching 1 GiB each held 6 GiB of the host. Where the scorer can make cgroups (root, with a writable
# v2 hierarchy whose parent delegates memory and pids, or v1's memory hierarchy), each sandbox gets one:
# CODE_MEMORY_BYTES of memory in all, no swap, and in v2 CODE_MAX_PROCS processes (in v1 the per-sandbox uid's
# RLIMIT_NPROC counts them already). Past the memory, the sandbox fails as a whole: v2 kills all of it
# (memory.oom.group); v1, which cannot, stops it (its OOM killer off) until the deadline kills it. Elsewhere a
# watchdog thread of the scorer sums the resident memory of the sandbox's processes every WATCHDOG_S and kills
# the sandbox past the budget (a bound by polling: what is allocated within one interval can pass it). Every
# sandboxed process is the OOM killer's first choice on the host (oom_score_adj 1000, sandboxed/limit.py): if
# memory runs short, a response dies, never the trainer.
_CGROUP_NAME = "balanced-grpo-sandboxes"
WATCHDOG_S = 0.01
_bound: tuple[str, str | None] | None = None
_cpu: str | None = None  # _cpu_base's answer, decided with _bound


def _own_cgroup(version: int, controller: str = "memory") -> str | None:
    """This process's cgroup directory in v2's hierarchy, or in v1's hierarchy of `controller` (None where not
    mounted)."""
    controller = "" if version == 2 else controller
    own = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if controller in (names.split(",") if names else [""]):
                own = path
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, fs = line.rstrip("\n").partition(" - ")
            root, point = fields.split()[3:5]
            fstype, _, options = fs.split()
            if own is not None and fstype == ("cgroup2" if version == 2 else "cgroup") and (
                    version == 2 or controller in options.split(",")):
                rel = os.path.relpath(own, root)
                return None if rel.startswith("..") else os.path.normpath(os.path.join(point, rel))
    return None


def _cgroup_base() -> tuple[str, str] | None:
    """Where the sandboxes' cgroups are made: v2 beside this process's cgroup (its parent must delegate memory
    and pids; a cgroup holding processes cannot), else v1 under this process's own; None where neither can."""
    for version in (2, 1):
        own = _own_cgroup(version)
        if own is None:
            continue
        if version == 2:
            # the root cgroup (no cgroup.type) may hold processes and delegate; any other must be the parent
            own = os.path.dirname(own) if os.path.exists(os.path.join(own, "cgroup.type")) else own
            try:
                with open(os.path.join(own, "cgroup.subtree_control")) as f:
                    if not {"memory", "pids"} <= set(f.read().split()):
                        continue
            except OSError:
                continue
        base = os.path.join(own, _CGROUP_NAME)
        try:
            os.makedirs(base, exist_ok=True)
            if version == 2:
                _write(base, "cgroup.subtree_control", "+memory +pids")
            _try_cgroup(base, "memory.max" if version == 2 else "memory.limit_in_bytes", str(CODE_MEMORY_BYTES))
        except OSError:  # read-only, or shadowed by another filesystem: the watchdog's bound, as without cgroups
            continue
        return f"cgroup{version}", base
    return None


def _try_cgroup(base: str, limit: str, value: str) -> None:
    """A cgroup made, limited and removed under `base`, or OSError: a read-only hierarchy refuses the first, and a
    directory that only looks like one (a tmpfs mounted over the hierarchy) has no cgroup.procs of the kernel's."""
    trial = os.path.join(base, f"trial-{os.getpid()}")
    os.makedirs(trial, exist_ok=True)
    try:
        if not os.path.exists(os.path.join(trial, "cgroup.procs")):
            raise OSError(errno.ENOTSUP, f"{base} is not a cgroup hierarchy")
        _write(trial, limit, value)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(trial)


def _cpu_base(kind: str, base: str) -> str | None:
    """Where each sandbox gets a CPU group of its own, one weight for all its processes: v2, the memory cgroup
    itself with the cpu controller enabled (cpu.weight); v1, the cpu hierarchy's folder of the sandboxes' groups.
    Without it the scheduler weighs every session a sandbox makes (setsid, autogroups) like another sandbox. None
    where no cpu controller is delegated."""
    try:
        if kind == "cgroup2":
            _write(base, "cgroup.subtree_control", "+cpu")  # refused where the parent does not delegate cpu
            return base
        own = _own_cgroup(1, "cpu")
        if own is None:
            return None
        cpu = os.path.join(own, _CGROUP_NAME)
        os.makedirs(cpu, exist_ok=True)
        _try_cgroup(cpu, "cpu.shares", "1024")
        return cpu
    except OSError:
        return None


def _memory_bound() -> tuple[str, str | None]:
    """("cgroup2" or "cgroup1", the sandboxes' cgroup base) or ("watchdog", None), decided once per scorer."""
    global _bound, _cpu
    if _bound is None:
        found = _cgroup_base() if os.geteuid() == 0 else None
        _cpu = _cpu_base(*found) if found else None
        _bound = found or ("watchdog", None)
    return _bound


def _write(directory: str, name: str, value: str) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(value)


@contextlib.contextmanager
def _sandbox_cgroup(uid: int) -> Iterator[list[int]]:
    """The cgroup of the sandbox holding `uid` (as root every running sandbox has its own uid), its limits
    written; yields [a descriptor to join it], which the sandbox's first process writes itself into
    (sandboxed/limit.py) before it runs anything else: whatever it starts later is counted there. Afterwards
    everything left in it is killed, and the cgroup is removed once empty (by the cleaner thread). [] where
    the bound is the watchdog's."""
    kind, base = _memory_bound()
    if uid < 0 or base is None:
        yield []
        return
    try:
        claim = _claim_dir(f"cgroup-{uid}", wait=CODE_TIMEOUT_S)
    except OSError:
        raise SandboxUnavailable(f"the sandbox cgroup {uid} is not given back") from None
    path = os.path.join(base, str(uid))
    cpu = os.path.join(_cpu, str(uid)) if _cpu is not None and _cpu != base else None  # v1's cpu hierarchy
    fds = []
    try:
        os.makedirs(path, exist_ok=True)
        _kill_cgroup(path)  # the directory is ours: whatever is left in it is a dead scorer's
        if kind == "cgroup2":
            _write(path, "memory.max", str(CODE_MEMORY_BYTES))
            with contextlib.suppress(FileNotFoundError):  # a kernel without swap accounting
                _write(path, "memory.swap.max", "0")
            _write(path, "memory.oom.group", "1")
            _write(path, "pids.max", str(CODE_MAX_PROCS))
        else:
            _write(path, "memory.limit_in_bytes", str(CODE_MEMORY_BYTES))
            try:
                _write(path, "memory.memsw.limit_in_bytes", str(CODE_MEMORY_BYTES))
            except FileNotFoundError:  # no swap accounting: keep its pages out of swap instead
                _write(path, "memory.swappiness", "0")
            _write(path, "memory.oom_control", "1")
        # v1: its `tasks` file, which moves the one thread that writes "0" to it without the thread-group lock
        # whose write side waits an RCU grace period (0.03 ms against 5 ms a start here); the sandbox's first
        # process has one thread then. v2 moves whole processes only.
        fds.append(os.open(os.path.join(path, "cgroup.procs" if kind == "cgroup2" else "tasks"), os.O_WRONLY))
        if cpu is not None:  # v1: a group of the cpu hierarchy too, at its default weight (cpu.shares 1024)
            os.makedirs(cpu, exist_ok=True)
            fds.append(os.open(os.path.join(cpu, "tasks"), os.O_WRONLY))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        claim.close()
        raise SandboxUnavailable(f"cannot set up the sandbox cgroup {path}: {e}") from None
    try:
        yield fds
    finally:
        for fd in fds:
            os.close(fd)
        _kill_cgroup(path)
        _cleanups.put((functools.partial(_remove_cgroups, [path] + ([cpu] if cpu else [])), claim))
        _start_cleaner()


def _remove_cgroups(paths: list[str]) -> None:
    for path in paths:
        _remove_cgroup(path)


def _kill_cgroup(path: str) -> None:
    try:
        _write(path, "cgroup.kill", "1")  # v2, Linux 5.14 on: all of it, at once
    except OSError:
        with contextlib.suppress(OSError):
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _remove_cgroup(path: str, wait: float = 5.0) -> None:
    """rmdir, once the killed processes have left (a moment after SIGKILL)."""
    deadline = time.monotonic() + wait
    while os.path.isdir(path):
        try:
            os.rmdir(path)
        except OSError:
            if time.monotonic() > deadline:
                log.warning("sandbox cgroup %s is still busy; left for the next scorer", path)
                return
            _kill_cgroup(path)
            time.sleep(0.005)


def _sandbox_tree(pid: int) -> list[int]:
    """The process and all its descendants (the sandbox: bubblewrap's processes and everything in its PID
    namespace, where orphans go to the namespace's init)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(x) for x in f.read().split()]
    return tree


def _resident_bytes(pids: list[int]) -> int:
    total = 0
    for p in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


@contextlib.contextmanager
def _watchdog(proc: subprocess.Popen, on: bool) -> Iterator[None]:
    """Where no cgroup bounds the sandbox: kills its whole process group and PID namespace once the resident
    memory of its processes together passes CODE_MEMORY_BYTES (checked every WATCHDOG_S)."""
    if not on:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(WATCHDOG_S):
            tree = _sandbox_tree(proc.pid)
            if _resident_bytes(tree) > CODE_MEMORY_BYTES:
                for p in reversed(tree):
                    with contextlib.suppress(OSError):
                        os.kill(p, signal.SIGKILL)
                return

    thread = threading.Thread(target=watch, name="sandbox-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _unshare_prefix() -> list[str]:
    return ["unshare", "--net", "--pid", "--fork", "--kill-child"]


@functools.cache
def _libseccomp() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        raise SandboxUnavailable("code rewards refuse the kernel keyring to sandboxes with a seccomp filter, which "
                                 "needs libseccomp (apt-get install libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.c_void_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    return lib


def _syscall_number(name: str) -> int:
    """The number of a system call on this machine's architecture (libseccomp's table, else the number
    every architecture gives a recent one)."""
    nr = _libseccomp().seccomp_syscall_resolve_name(name.encode())
    if nr < 0 and name in _UNIFIED_SYSCALLS:
        return _UNIFIED_SYSCALLS[name]
    if nr < 0:
        raise SandboxUnavailable(f"libseccomp does not know the system call {name}")
    return nr


class _ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def seccomp_rules() -> tuple:
    """Every rule of the sandbox's filter, (system call, errno, None or (argument, op, value)): REFUSED_SYSCALLS
    (EPERM), clone3 (ENOSYS: its flags sit in memory a filter cannot read; the C library then falls back to
    clone), clone with each CLONE_NEW* flag (EPERM), and SHARED_STATE_RULES. tests/test_sandbox_isolation.py
    holds a probe for each, and shows each probe refused by its rule alone."""
    return (*((name, errno.EPERM, None) for name in REFUSED_SYSCALLS), ("clone3", errno.ENOSYS, None),
            *(("clone", errno.EPERM, (0, "&", flag)) for flag in _CLONE_NEW), *SHARED_STATE_RULES)


@functools.cache
def _seccomp_program(rules: tuple) -> bytes:
    """A seccomp filter, as `bwrap --seccomp` loads it (classic BPF), that answers each of `rules`
    (seccomp_rules) with its errno and allows the rest; compiled by libseccomp for this machine's
    architecture, so a system call through another ABI (32-bit, x32) kills the process instead of slipping
    past. clone's flags are its first argument on x86-64, arm64 and ppc64le (not on s390x)."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW
    if not ctx:
        raise SandboxUnavailable("libseccomp cannot build a filter here")
    try:
        for name, code, cmp in rules:
            args = ctypes.byref(_arg_cmp(cmp)) if cmp is not None else None
            action = 0x00050000 | code  # SCMP_ACT_ERRNO(code)
            if lib.seccomp_rule_add_array(ctx, action, _syscall_number(name), int(cmp is not None), args) != 0:
                raise SandboxUnavailable(f"libseccomp cannot refuse {name} here")
        fd = os.memfd_create("seccomp")
        try:
            if lib.seccomp_export_bpf(ctx, fd) != 0:
                raise SandboxUnavailable("libseccomp cannot export its filter")
            os.lseek(fd, 0, os.SEEK_SET)
            with open(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def _arg_cmp(cmp: tuple[int, str, int]) -> _ArgCmp:
    """libseccomp's comparison: argument == value, >= value (unsigned, all 64 bits), or & value set."""
    arg, op, value = cmp
    if op == "&":
        return _ArgCmp(arg, 7, value, value)  # SCMP_CMP_MASKED_EQ
    return _ArgCmp(arg, {"==": 4, ">=": 5}[op], value, 0)  # SCMP_CMP_EQ, SCMP_CMP_GE


def _fd_holding(data: bytes, pipe: bool = False) -> int:
    """A file descriptor to hand to a sandbox, positioned at the start of `data`: a pipe's reading end
    (small data, which bwrap reads to its end), else an anonymous file (memfd: no path, no disk)."""
    if pipe:
        r, w = os.pipe()
        try:
            os.write(w, data)  # less than a pipe's buffer
        finally:
            os.close(w)
        return r
    fd = os.memfd_create("reward-bundle")
    with open(fd, "wb", closefd=False) as f:
        f.write(data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@contextlib.contextmanager
def _workdir(mode: str) -> Iterator[str]:
    """Where the sandbox starts. Under bubblewrap a tmpfs inside it: nothing is made here. The weaker
    modes run in a fresh directory of the host's, removed afterwards (the worker's whole directory,
    by its parent, if the worker is killed)."""
    if mode == "bwrap":
        yield "/"
        return
    if _TMP_ROOT is not None:
        os.makedirs(_TMP_ROOT, mode=0o700, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="reward-", dir=_TMP_ROOT)
    try:
        os.chmod(workdir, 0o777)  # the program runs as another user
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _limits(mode: str, timeout: float, uid: int) -> list[int]:
    return [math.ceil(timeout) + 1, CODE_MEMORY_BYTES, CODE_MAX_PROCS if _nproc_per_sandbox(mode, uid) else 0,
            CODE_MAX_FILE_BYTES, uid]


def _nproc_per_sandbox(mode: str, uid: int) -> bool:
    """Whether RLIMIT_NPROC would count this sandbox's processes only: under a uid of its own (root), or,
    unprivileged, in bubblewrap's user namespace, which the kernel counts apart from 5.14 on (before,
    the trainer user's own processes and threads would count against the sandbox's limit)."""
    if uid >= 0:
        return True
    release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    return mode == "bwrap" and release >= (5, 14)


@contextlib.contextmanager
def _sandbox(files: dict[str, str], program: str, timeout: float, params: dict, talk: bool = False,
             data: object = None, mode: str | None = None):
    """One sandbox start: sandboxed/PROGRAM.py run by the sandbox's Python, which first writes `files` into its
    directory and finds `data` (marshal-able) in unpack() (sandboxed/limit.py); yields the process (its
    stdout a pipe, its stdin and stderr too if `talk`); everything it started is killed when the block ends."""
    mode = mode or sandbox_mode()
    seccomp_program = _seccomp_program(seccomp_rules()) if mode == "bwrap" else None
    with (_sandbox_uid(mode) as uid, _workdir(mode) as workdir, _private_tmpfs(mode, uid) as tmpfs,
          _sandbox_cgroup(uid) as cgroup):
        bundle = _fd_holding(marshal.dumps((files, data)))
        seccomp = _fd_holding(seccomp_program, pipe=True) if seccomp_program is not None else None
        params = {**params, "limits": _limits(mode, timeout, uid), "bundle": bundle, "mode": mode, "cgroup": cgroup,
                  "hide_proc": HIDE_PROC and mode == "bwrap", "seal_devices": SEAL_DEVICES and mode == "bwrap"}
        # -B: nothing written beside the programs (their folder is read-only in the sandbox, the project's outside)
        where = "/prog" if mode == "bwrap" else str(SANDBOXED)
        python = [_sandbox_python(mode), "-I", "-B", f"{where}/{program}.py", marshal.dumps(params).hex()]
        if mode == "bwrap":
            cmd = _bwrap_prefix(seccomp, tmpfs) + python
        elif mode == "unshare":
            cmd = _unshare_prefix() + python
        else:
            cmd = python
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        pipe_if_talk = subprocess.PIPE if talk else subprocess.DEVNULL
        fifos = _fifos(tmpfs) if talk and tmpfs else None
        try:
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=fifos[0][0] if fifos else pipe_if_talk,
                                    stdout=fifos[1][1] if fifos else subprocess.PIPE,
                                    stderr=fifos[2][1] if fifos else pipe_if_talk, start_new_session=True,
                                    pass_fds=[fd for fd in (bundle, seccomp, *cgroup) if fd is not None])
        except BaseException:
            for fd in (fifos[0][1], fifos[1][0], fifos[2][0]) if fifos else ():
                os.close(fd)
            raise
        finally:  # the sandbox holds its own copies
            for fd in (bundle, seccomp, *((fifos[0][0], fifos[1][1], fifos[2][1]) if fifos else ())):
                if fd is not None:
                    os.close(fd)
        if fifos:
            proc.stdin, proc.stdout, proc.stderr = (open(fifos[0][1], "wb", buffering=0),
                                                    open(fifos[1][0], "rb", buffering=0),
                                                    open(fifos[2][0], "rb", buffering=0))
        try:
            with _watchdog(proc, on=not cgroup):
                yield proc
        finally:
            _kill_group(proc)


def _fifos(tmpfs: str) -> list[tuple[int, int]]:
    """(reading end, writing end) of three FIFOs in the sandbox's own tmpfs, for its stdin, stdout and stderr: a
    pipe's inode is numbered from a counter of the whole host, which the program could read with fstat on the
    descriptors it is handed; a FIFO's inode is its tmpfs's own. The ends the sandbox gets block; the scorer's
    do not (it waits on them with select)."""
    os.makedirs(os.path.join(tmpfs, ".channel"), mode=0o700, exist_ok=True)
    fds = []  # reading end, writing end, of each in turn
    try:
        for name in ("in", "out", "prints"):
            path = os.path.join(tmpfs, ".channel", name)
            os.mkfifo(path, 0o600)
            fds.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # a reader first: opening the writer cannot wait
            fds.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            os.set_blocking(fds[-2] if name == "in" else fds[-1], True)
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return list(zip(fds[::2], fds[1::2]))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass


class _Broken(Exception):
    """The sandboxed side went silent past the deadline, closed its end, or wrote past its budget."""


class _Link:
    """The pipes to a sandboxed process, used within a deadline and a byte budget: whatever the
    process writes (or withholds), the scorer's time and memory stay bounded. What the program
    prints (the process's stderr pipe, where there is one) is read, counted and dropped."""

    def __init__(self, proc: subprocess.Popen, deadline: float, budget: int):
        self.proc, self.deadline, self.budget, self.buf = proc, deadline, budget, bytearray()
        self.prints = proc.stderr.fileno() if proc.stderr else None

    def _count(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise _Broken("past the output cap")

    def _wait(self, fd: int, write: bool = False) -> None:
        """Until fd is ready to read (or write), draining the prints meanwhile."""
        while True:
            left = self.deadline - time.monotonic()
            watch = [self.prints] if self.prints is not None else []
            readable, writable, _ = select.select(watch if write else [fd, *watch], [fd] if write else [], [],
                                                  max(0.0, left))
            if not readable and not writable:
                raise _Broken("timed out")
            if self.prints in readable:
                data = os.read(self.prints, 1 << 16)
                if data:
                    self._count(len(data))
                else:
                    self.prints = None
            if fd in readable or fd in writable:
                return

    def _fill(self) -> None:
        fd = self.proc.stdout.fileno()
        self._wait(fd)
        data = os.read(fd, 1 << 16)
        if not data:
            raise _Broken("closed")
        self._count(len(data))
        self.buf += data

    def line(self) -> bytes:
        start = 0
        while (end := self.buf.find(b"\n", start)) < 0:
            start = len(self.buf)
            self._fill()
        out = bytes(self.buf[:end])
        del self.buf[: end + 1]
        return out

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def send(self, data: bytes) -> None:
        # Non-blocking: a process that stops reading cannot hold the scorer past the deadline.
        fd = self.proc.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(data)
        while view:
            self._wait(fd, write=True)
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                pass
            except OSError as e:  # the process closed its end (or died)
                raise _Broken("closed") from e


# --- stdin/stdout tests: every case of a response in one sandbox start ---------------------------
#
# A runner in the sandbox (sandboxed/case_runner.py) forks each case from its own already-started
# interpreter (no Python start-up per case), as its own process: own session, limits, the sandbox's
# uid, the case's input as stdin (an anonymous file, memfd, that only this case is handed: no case can
# read another's), its stdout read up to CODE_MAX_OUTPUT_BYTES and its wall time bounded; afterwards
# everything it left running is killed. The expected outputs never enter the sandbox: the runner
# sends each case's exit code and output back and the comparison happens here.

def run_cases(program: str, inputs: list[str], timeout: float = CODE_TIMEOUT_S) -> Iterator[tuple[int, str, bool]]:
    """Run a Python program once per input, all in one sandbox start; yields (exit code, stdout,
    timed out) per input, in order. A run past its limits yields (-9, "", timed out)."""
    done = 0
    params = {"timeout": timeout, "cap": CODE_MAX_OUTPUT_BYTES}
    with _sandbox({"main.py": program}, "case_runner", timeout, params, data=list(inputs)) as proc:
        link = _Link(proc, time.monotonic() + 5 + len(inputs) * (timeout + 1),
                     len(inputs) * (CODE_MAX_OUTPUT_BYTES + 64))
        try:
            for _ in inputs:
                rc, timed_out, size = map(int, link.line().split())
                if not 0 <= size <= CODE_MAX_OUTPUT_BYTES:
                    break
                yield rc, link.exact(size).decode(errors="replace"), bool(timed_out)
                done += 1
        except (_Broken, ValueError):  # the runner died or lied: the cases left fail
            pass
    for _ in range(len(inputs) - done):
        yield -9, "", True


def run_sandboxed(program: str, stdin: str = "", timeout: float = CODE_TIMEOUT_S) -> tuple[int, str, bool]:
    """Run a Python program in the sandbox; returns (exit code, stdout, timed out)."""
    return list(run_cases(program, [stdin], timeout))[0]


# --- function tests: the call server's client -------------------------------------------------------
#
# The tested code runs alone in the sandbox behind a call server: no test, no expected value,
# nothing secret is in there. The benchmark's check (trusted) runs here, in the scorer, with
# `candidate` a stub: each call sends its arguments over the pipe, the server calls the real
# function, and what it returns comes back as plain data, rebuilt here from a strict encoding of
# builtin types only (an object equal to everything, an int subclass, a patched builtin cannot
# cross). The sandbox has its own PID namespace and user: it cannot see, signal or trace this
# process. Whatever breaks the protocol fails the test.


class Disqualified(BaseException):
    """The tested code broke the protocol (a result that is not plain data, a dead or silent
    sandbox): the test fails, whatever the check does. Not an Exception, so that a test's own
    `except Exception` cannot swallow it; and recorded, so that a bare `except:` cannot either."""


def _reraised(name: str, message: str) -> BaseException | None:
    """What the tested code raised, as the builtin exception of that name (tests may expect a
    ValueError); a name that is no builtin exception becomes a plain Exception, a StopIteration
    too (it would end the check's own loops early); None for SystemExit and the like."""
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, Exception):
        return None
    if not (isinstance(cls, type) and issubclass(cls, Exception)) or issubclass(cls, (StopIteration,
                                                                                      StopAsyncIteration)):
        return Exception(f"{name}: {message}")
    try:
        return cls(message)
    except Exception:  # builtins that take other arguments (UnicodeDecodeError)
        return cls.__new__(cls)


class _Calls:
    """This side of the call server: `candidate`, and the objects it makes, call through here."""

    def __init__(self, link: _Link):
        self.link, self.broken = link, False

    def ready(self) -> bool:
        """The server has run the solution and waits for calls."""
        try:
            return self.link.line() == b'["ready",null]'
        except _Broken:
            return False

    def call(self, target: list | None, args: tuple, kwargs: dict):
        if not self.broken:
            try:
                request = marshal.dumps([target, encode_plain(args), encode_plain(kwargs)])
                self.link.send(len(request).to_bytes(8, "little") + request)
                kind, body = json.loads(self.link.line())
                if kind == "value":
                    return decode_plain(body)
                if kind == "object" and target is None and type(body) is str and body.isdigit():
                    return _Remote(self, int(body))
                name, message = decode_plain(body) if kind == "raised" else (None, None)
                error = _reraised(name, message) if type(name) is str and type(message) is str else None
            except Exception:  # _Broken, or a reply no server sends: nothing of it reaches the test
                error = None
            if error is not None:
                raise error
        self.broken = True
        raise Disqualified


class _Remote:
    """An instance the entry point made in the sandbox: its methods run there. It has no value on
    this side: it equals only itself."""

    __slots__ = ("_calls", "_id")

    def __init__(self, calls: _Calls, i: int):
        self._calls, self._id = calls, i

    def __getattr__(self, name: str):
        if name.startswith("__"):  # protocols probed by copy, pickle, pprint: not the tested methods
            raise AttributeError(name)
        return lambda *args, **kwargs: self._calls.call([self._id, name], args, kwargs)


@contextlib.contextmanager
def call_server(code: str, prelude: str, entry: str, timeout: float = CODE_TIMEOUT_S) -> Iterator[_Calls]:
    """The solution `code` (after `prelude`) in one sandbox behind sandboxed/call_server.py, within `timeout`;
    yields the scorer's side: .ready() once the server says so, .call(None, args, kwargs) calls `entry`."""
    with _sandbox({"main.py": code, "prelude.py": prelude}, "call_server", timeout, {"entry_point": entry},
                  talk=True) as proc:
        yield _Calls(_Link(proc, time.monotonic() + timeout, CODE_MAX_OUTPUT_BYTES))


# --- the scoring workers' side (rewards.compute_rewards) ----------------------------------------------------


def as_worker(tmp_root: str, root: str) -> None:
    """In a scoring worker: its directory for the weaker modes' sandboxes, and its parent's sandbox root."""
    global _TMP_ROOT, _IN_WORKER, _root
    _TMP_ROOT, _IN_WORKER, _root = tmp_root, True, root or False


def shared_root() -> str | None:
    """The sandbox root to hand to workers (bubblewrap only), made here first if need be."""
    return _sandbox_root() if _sandbox_mode == "bwrap" else None


def sweep_leftovers() -> None:
    """What sandboxes of a dead scorer left: their tmpfs mounts and cgroups."""
    _sweep_tmpfs()
