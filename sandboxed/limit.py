"""The start of every program run in the sandbox (rewards._sandbox): `params` (limits, counts, names, file
descriptors: nothing a program could use), handed over marshalled in argv; `unpack`, which writes the files
the program was handed (as the sandbox's root, so that the program cannot change them) and returns its data;
and `limit`: resource limits, then the sandbox's own uid. On import, before anything else runs: the process
(and so everything it starts) becomes the host OOM killer's first choice and joins the sandbox's cgroup.
No json in here: its import (with `re`) would be a third of a sandbox's start-up.
"""

import marshal
import os
import resource
import sys

params = marshal.loads(bytes.fromhex(sys.argv[1]))


def bound():
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    for fd in params["cgroup"]:  # the sandbox's cgroups (cgroup.procs, or v1's tasks: this one thread)
        os.write(fd, b"0")
        os.close(fd)
    if params.get("probe"):  # what the kernel holds now, for the start-up probe (sandboxed/probe.py)
        with open("/proc/self/oom_score_adj") as f, open("/proc/self/cgroup") as g:
            seen.update(oom=f.read().strip(), cgroup=g.read())
    if params["hide_proc"]:
        hide_proc()
    if params["seal_devices"]:
        seal_devices()


def seal_devices():
    """/dev's nodes are the host's inodes, bound in: every sandbox would see a change of their metadata (times, mode,
    owner, extended attributes; one sandbox stamped results into /dev/null's mtime for others to read). Each bind is
    remounted read-only, devices still allowed (bubblewrap's own --remount-ro adds nodev): their data is still read
    and written, their metadata no more. As root in the sandbox's mount namespace; where the sandbox may not
    remount (unprivileged) they stay as bound, and the start-up probe says so."""
    import _ctypes

    class Libc:
        _handle = _ctypes.dlopen(None)

    class Call(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO

    mount = Call(("mount", Libc))
    for node in (b"/dev/null", b"/dev/zero", b"/dev/full", b"/dev/random", b"/dev/urandom"):
        mount(None, node, None, 32 | 4096 | 1 | 2, None)  # MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID


def hide_proc():
    """No /proc at all for the program: every file of procfs is either the host's (vmstat, meminfo, loadavg, net,
    ...) or a process's own view of what it shares with other sandboxes (smaps' counts of who maps its pages,
    mountinfo's device numbers, numbers of the kernel's own counters in its inodes), and a sandbox can move the
    one and read the other (tests/test_channel_scan.py). As root in the sandbox's own mount namespace, before the
    program runs; where the sandbox may not unmount (unprivileged) /proc stays bubblewrap's (docs/rewards.md).
    _ctypes, not ctypes: a tenth of its import time (0.3 ms of a 16 ms start)."""
    import _ctypes

    class Libc:
        _handle = _ctypes.dlopen(None)

    class Call(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO

    Call(("umount2", Libc))(b"/proc", 2)  # MNT_DETACH: /proc/sys's tmpfs with it


seen = {}
bound()


def unpack():
    with open(params["bundle"], "rb") as f:
        files, data = marshal.loads(f.read())
    for name, text in files.items():
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)
    return data


def limit(cpu, mem, procs, fsize, uid):
    for what, n in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                    (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (n, n))
    if uid >= 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if procs > 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
