"""The scorer's start-up probe (rewards._probe_bwrap): one sandbox as responses get it must find the kernel
keyring, new namespaces and file locks refused, its own directory writable, itself the OOM killer's first
choice, inside its cgroups where it was handed them; and whether its /proc shows the host's files."""

import ctypes
import errno
import fcntl
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the program's own folder off sys.path
from limit import limit, params, unpack  # noqa: E402

unpack()
limit(*params["limits"])
libc = ctypes.CDLL(None, use_errno=True)
keyring = libc.syscall(params["add_key"], b"user", b"probe", b"x", 1, -4) != -1 or ctypes.get_errno() != errno.EPERM
namespace = libc.unshare(0x10000000) != -1 or ctypes.get_errno() != errno.EPERM  # CLONE_NEWUSER
with open("probe", "w") as f:
    f.write("x")
    try:
        fcntl.flock(f, fcntl.LOCK_SH)
        locks = True
    except OSError as e:
        locks = e.errno != errno.ENOLCK

with open("/proc/self/oom_score_adj") as f:
    oom = f.read().strip() != "1000"
with open("/proc/self/cgroup") as f:
    joined = f.read()
unbounded = joined.count(f"/{params['cgroup_name']}/") < len(params["cgroup"])  # a line per hierarchy joined
# /proc holds the sandbox's processes only, no host-wide file (limit.private_proc), where the mount was allowed
host = any(not e.isdigit() and e not in ("self", "thread-self") for e in os.listdir("/proc"))

print("keyring reachable" if keyring else "namespaces allowed" if namespace else "locks shared" if locks else
      "not the OOM killer's first choice" if oom else "outside its cgroup" if unbounded else
      "isolated, the host's /proc in view" if host else "isolated", flush=True)
