"""The scorer's start-up probe (rewards._probe_bwrap): one sandbox as responses get it must find the kernel
keyring, new namespaces and file locks refused, its own directory writable, itself the OOM killer's first
choice, inside its cgroups where it was handed them (as the kernel reported them to limit.bound before /proc
went), the device nodes' metadata read-only where /proc went; and whether a /proc is still there."""

import ctypes
import errno
import fcntl
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the program's own folder off sys.path
from limit import limit, params, seen, unpack  # noqa: E402

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

oom = seen["oom"] != "1000"
unbounded = seen["cgroup"].count(f"/{params['cgroup_name']}/") < len(params["cgroup"])  # a line per hierarchy joined
host = os.path.exists("/proc/self")  # limit.hide_proc unmounts it where the sandbox may
try:  # limit.seal_devices, with it: a change of a shared node's times would be every sandbox's to read
    os.utime("/dev/null")
    stamps = True
except OSError:
    stamps = False
print("keyring reachable" if keyring else "namespaces allowed" if namespace else "locks shared" if locks else
      "not the OOM killer's first choice" if oom else "outside its cgroup" if unbounded else
      "isolated, the host's /proc in view" if host else "device nodes' times writable" if stamps else "isolated",
      flush=True)
