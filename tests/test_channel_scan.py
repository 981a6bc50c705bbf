"""A differential scan for channels between sandboxes, not a list of them (docs/rewards.md, "Between responses").

A writer sandbox does every kind of thing a program can (memory of each kind, locked and advised; processes,
sessions and threads; files, pipes and sockets; timers and signals; CPU) in alternate windows, idle in the
others, while a reader sandbox snapshots everything it can read: every file under /proc and /sys it can open,
sysconf, sysinfo, its resource usage, and the numbers the kernel gives new objects (a pipe's, a socket's and a
memfd's inode, a socket's cookie). A number that moves with the writer's windows (every active window's change beyond
every idle window's, by more than their spread) is a channel, unless it is the reader's own scheduling, which
CPU contention moves (TIME_ONLY), what the scorer hands it (HANDED), or one of the channels found and not
closed yet, which docs/rewards.md lists (KNOWN_OPEN). The same scan runs between a writer and later sandboxes.
A control takes the new masks away and shows the scan finding what each hid.
"""

import inspect
import os
import re
import shutil
import threading
import time

import pytest

from sandboxed import sandbox

pytestmark = [pytest.mark.skipif(not shutil.which("bwrap"), reason="the scan is of bubblewrap's sandboxes"),
              pytest.mark.skipif(os.geteuid() != 0, reason="the private /proc and the cgroups are the root path")]

PERIOD = 0.8  # seconds a window (each of the writer's rounds of everything takes 10-100 ms)
WINDOWS = 4  # active windows (as many idle ones between them)

# The reader's own scheduling: its CPU time, context switches, the CPU it ran on and the scheduler's statistics
# of its own tasks (and their AVX-512 use). The writer moves them only by taking CPU: a time-only signal.
TIME_ONLY = re.compile(r"^/proc/P\d+(/task/T)?/(sched|schedstat|stat|status|arch_status)$|^rusage$")
# What the scorer hands each sandbox: its command line (the limits, the uid drawn at random, descriptors).
HANDED = re.compile(r"^/proc/P\d+(/task/T)?/cmdline$")

def scan_reader(t0: float, period: float, snapshots: int) -> None:
    """Snapshots at t0 + k * period, k < snapshots, printed as one JSON list of {name: text}."""
    import ctypes
    import json
    import os
    import resource
    import socket
    import struct
    import time

    libc = ctypes.CDLL(None, use_errno=True)
    def fifo():
        if not os.path.exists("scan-fifo"):
            os.mkfifo("scan-fifo")
        return os.open("scan-fifo", os.O_RDWR)

    skip = {"kmsg", "kcore", "pagemap", "kpagecount", "kpageflags", "kpagecgroup", "mem", "clear_refs",
            "kallsyms", "trace_pipe"}

    def numbered(path):  # /proc/<pid> by the order of the pids it sees: one name across snapshots and sandboxes
        parts = path.split("/")
        if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit():
            parts[2] = f"P{pids.index(parts[2])}"
            if len(parts) > 4 and parts[3] == "task" and parts[4].isdigit():
                parts[4] = "T"
        return "/".join(parts)

    def snapshot():
        out = {}  # the quick reads first, then the files (a full /proc takes a tenth of a second and more)
        for name in os.sysconf_names:
            try:
                out["sysconf:" + name] = str(os.sysconf(name))
            except (OSError, ValueError):
                pass
        out["rusage"] = " ".join(map(str, resource.getrusage(resource.RUSAGE_SELF)))
        info = ctypes.create_string_buffer(128)  # struct sysinfo: uptime, loads, memory, swap, procs
        if libc.sysinfo(info) == 0:
            fields = struct.unpack_from("l3L6LH", info)[1:]
            out["sysinfo"] = "loads, memory, swap, processes " + " ".join(map(str, fields))
        else:
            out["sysinfo"] = f"refused {ctypes.get_errno()}"
        # the numbers the kernel gives new objects of every kind a program can make (a refusal is a constant)
        for kind, make in (("pipe", os.pipe), ("socket", lambda: [x.detach() for x in socket.socketpair()]),
                           ("memfd", lambda: os.memfd_create("scan")), ("eventfd", lambda: os.eventfd(0)),
                           ("epoll", lambda: libc.epoll_create1(0)), ("timerfd", lambda: libc.timerfd_create(1, 0)),
                           ("pidfd", lambda: os.pidfd_open(os.getpid())), ("file", lambda: os.open(
                               "scan-file", os.O_RDWR | os.O_CREAT | os.O_TRUNC)), ("fifo", fifo)):
            try:
                # the kernel hands such numbers out in batches of 1024 per CPU: the last of 1100 is from a
                # batch taken now, wherever the counter stands, whichever CPU made the others
                for _ in range(1100 if kind not in ("file", "fifo") else 1):
                    made = make()
                    fd, *others = made if isinstance(made, (tuple, list)) else [made]
                    st = os.fstat(fd)
                    for x in (fd, *others):
                        os.close(x)
                out[f"inode of a new {kind}"] = f"{st.st_ino} {st.st_dev}"
                if kind == "socket":
                    with socket.socket(socket.AF_UNIX) as a:
                        try:
                            out["cookie of a new socket"] = str(int.from_bytes(a.getsockopt(1, 57, 8), "little"))
                        except OSError as e:
                            out["cookie of a new socket"] = f"refused {e.errno}"
            except OSError as e:
                out[f"inode of a new {kind}"] = f"refused {e.errno}"
        # what it holds and where it is: its descriptors and every place it can name, and their file systems
        for fd in (0, 1, 2):
            st = os.fstat(fd)
            out[f"fd {fd}"] = f"inode {st.st_ino} dev {st.st_dev} rdev {st.st_rdev} size {st.st_size}"
        for path in ("/", "/tmp", "/sandbox", "/dev", "/dev/null", "/dev/urandom", "/proc", "/prog", "/usr"):
            try:
                st, fs = os.stat(path), os.statvfs(path)
                out[f"stat {path}"] = f"inode {st.st_ino} dev {st.st_dev} links {st.st_nlink} size {st.st_size}"
                out[f"statvfs {path}"] = " ".join(map(str, fs))
            except OSError as e:
                out[f"stat {path}"] = f"refused {e.errno}"
        out["uname"] = " ".join(os.uname())
        out["scheduling"] = f"{os.sched_getaffinity(0)} {os.getpriority(os.PRIO_PROCESS, 0)} {os.cpu_count()}"
        for root in ("/proc", "/sys"):
            for d, dirs, files in os.walk(root):
                dirs[:] = [x for x in dirs if x not in ("self", "thread-self", "fd", "fdinfo", "map_files")]
                out[numbered(d) + "/"] = str(len(files) + len(dirs))
                for f in files:
                    if f in skip:
                        continue
                    try:
                        fd = os.open(os.path.join(d, f), os.O_RDONLY | os.O_NONBLOCK)
                        try:
                            out[numbered(os.path.join(d, f))] = os.read(fd, 1 << 16).decode("latin-1")
                        finally:
                            os.close(fd)
                    except OSError:
                        pass
        return out

    def numbers(shot):
        """Every number of every value, named FILE:LINE[k]: its line by the line's label (its first word with a
        letter and no digit, and which of the lines so labelled) or else its place, and k-th number in the line;
        so a line that comes or goes does not rename the others."""
        out = {}
        for name, text in shot.items():
            seen = {}
            for i, line in enumerate(text.splitlines()):
                label = next((w for w in line.split() if re.search("[A-Za-z]", w) and not re.search("[0-9]", w)),
                             f"line {i}")
                seen[label] = seen.get(label, 0) + 1
                where = f"{name}:{label}#{seen[label]}"
                for k, x in enumerate(re.findall(r"-?\d+(?:\.\d+)?", line)):
                    out[f"{where}[{k}]"] = float(x)
        return out

    import re

    pids = sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int)
    shots = []
    for k in range(snapshots):
        time.sleep(max(0.0, t0 + k * period - time.monotonic()))
        shots.append(numbers(snapshot()))
    if snapshots == 1:  # a later sandbox's one snapshot, whole: what differs is across sandboxes
        print(json.dumps(shots[0]))
        return
    # what was there every time, and changed (the rest cannot carry anything; printed whole it is megabytes)
    keys = set.intersection(*map(set, shots))
    print(json.dumps({k: [s[k] for s in shots] for k in sorted(keys) if len({s[k] for s in shots}) > 1}))


def scan_writer(t0: float, period: float, windows: int, every: int = 2) -> None:
    """Busy in windows 0, every, 2 * every, ... (from 30% to 90% of each: a snapshot reads for up to an eighth of a
    second, with /proc in view, from each edge, so the one at its start sees nothing of it yet and the one at its
    end sees it finished, its processes and memory still held), idle otherwise: memory touched, locked, advised
    and freed, shared and anonymous; processes, sessions and threads; files, FIFOs, pipes, sockets, memfds,
    eventfds, pidfds and SysV shared memory; timers and signals; CPU."""
    import ctypes
    import mmap
    import os
    import signal
    import socket
    import threading
    import time

    libc = ctypes.CDLL(None, use_errno=True)
    signal.signal(signal.SIGALRM, lambda *_: None)
    signal.signal(signal.SIGUSR1, lambda *_: None)

    def busy(until):
        if not os.path.exists("w-fifo"):
            os.mkfifo("w-fifo")
        while time.monotonic() < until:
            m = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE)  # anonymous (MADV_FREE takes private pages only)
            m.write(b"x" * (4 << 20))
            address = ctypes.addressof(ctypes.c_char.from_buffer(m))
            libc.mlock(ctypes.c_void_p(address), 1 << 20)
            libc.munlock(ctypes.c_void_p(address), 1 << 20)
            for advice in (8, 4):  # MADV_FREE, MADV_DONTNEED
                libc.madvise(ctypes.c_void_p(address), 2 << 20, advice)
            del address
            m.close()
            for _ in range(2):
                pid = os.fork()
                if pid == 0:
                    os.setsid()
                    os._exit(0)
                os.waitpid(pid, 0)
            threads = [threading.Thread(target=sum, args=(range(10000),)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i in range(20):
                with open(f"f{i}", "wb") as f:
                    f.write(b"y" * 4096)
                os.unlink(f"f{i}")
            # two batches of numbers each, whatever CPU the reader takes its own on (a refusal ends a kind)
            for make in (os.pipe, socket.socketpair, lambda: [os.memfd_create("w")]):
                try:
                    for _ in range(2000):
                        for end in make():
                            if isinstance(end, socket.socket):
                                try:
                                    end.getsockopt(socket.SOL_SOCKET, 57, 8)  # SO_COOKIE: numbered on first asking
                                except OSError:
                                    pass
                                end.close()
                            else:
                                os.close(end)
                except OSError:
                    pass
            shared = mmap.mmap(-1, 1 << 20)  # shared and anonymous: an inode of shmem's internal mount
            shared.write(b"s" * (1 << 20))
            shared.close()
            for _ in range(20):
                for make in (lambda: os.eventfd(0), lambda: os.open("w-fifo", os.O_RDWR), lambda: os.pidfd_open(1)):
                    try:
                        os.close(make())
                    except OSError:
                        pass
            ident = libc.shmget(0, 1 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT
            libc.shmctl(ident, 0, None)  # IPC_RMID
            for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_UNIX):
                try:
                    s = socket.socket(family, socket.SOCK_DGRAM)
                    s.close()
                except OSError:
                    pass
            signal.setitimer(signal.ITIMER_REAL, 0.0005)
            os.kill(os.getpid(), signal.SIGUSR1)
            end = time.monotonic() + 0.01
            while time.monotonic() < end:
                pass

    for k in range(0, windows, every):
        start = t0 + k * period
        time.sleep(max(0.0, start + 0.3 * period - time.monotonic()))
        held = b"h" * (32 << 20)  # held over the window's end: what levels show (memory, processes)
        sleepers = []
        for _ in range(16):
            pid = os.fork()
            if pid == 0:
                time.sleep(60)  # until killed, past the snapshot at the window's end however late it reads
                os._exit(0)
            sleepers.append(pid)
        busy(start + 0.9 * period)
        time.sleep(max(0.0, start + 1.3 * period - time.monotonic()))  # past the reader's snapshot at its end
        del held
        for pid in sleepers:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    print("done")


def ship(fn, *args) -> str:
    return f"{inspect.getsource(fn)}\n{fn.__name__}(*{args!r})\n"


def what(key: str) -> str:
    """The file (or other source) of a number's name, FILE:LINE[k]."""
    return key.split(":", 1)[0]


def channels(series: dict[str, list[float]], active: list[bool]) -> dict[str, tuple]:
    """The numbers that move with the writer: every change over an active interval beyond every change over an
    idle one by more than the idle changes' spread (or below, by as much); TIME_ONLY and HANDED left out."""
    found = {}
    for key, values in sorted(series.items()):
        if any(r.search(what(key)) for r in (TIME_ONLY, HANDED)):
            continue
        deltas = [values[k + 1] - values[k] for k in range(len(values) - 1)]
        on = [d for d, a in zip(deltas, active) if a]
        off = [d for d, a in zip(deltas, active) if not a]
        spread = max(off) - min(off)
        if min(on) > max(off) + spread or max(on) < min(off) - spread:
            found[key] = (on, off)
    return found


def concurrent_scan() -> dict[str, tuple]:
    """The reader and the writer side by side, as two responses of one batch."""
    import json

    t0 = time.monotonic() + 2.0  # both sandboxes started by then (0.05 to 0.5 s each, loaded)
    intervals = 2 * WINDOWS
    got = {}
    writer = threading.Thread(target=lambda: got.update(
        writer=sandbox.run_sandboxed(ship(scan_writer, t0, PERIOD, intervals), timeout=30)))
    writer.start()
    rc, out, timed_out = sandbox.run_sandboxed(ship(scan_reader, t0, PERIOD, intervals + 1), timeout=30)
    writer.join()
    assert rc == 0 and not timed_out and got["writer"][1].strip() == "done", (rc, out[-2000:], got)
    return channels(json.loads(out), [k % 2 == 0 for k in range(intervals)])


def later_scan() -> dict[str, tuple]:
    """Readers one after another, a writer busy (or idle) between each two, as responses of later batches."""
    import json

    shots, active = [], []
    for k in range(2 * WINDOWS + 1):
        rc, out, _ = sandbox.run_sandboxed(ship(scan_reader, 0.0, 0.0, 1), timeout=30)
        assert rc == 0, out[-2000:]
        shots.append(json.loads(out))
        if k < 2 * WINDOWS:
            busy = k % 2 == 0
            t0 = time.monotonic() + 0.2
            program = ship(scan_writer, t0, PERIOD / 2, 1) if busy else f"import time\ntime.sleep({PERIOD / 2 + 0.2})\n"
            assert sandbox.run_sandboxed(program, timeout=30)[0] == 0
            active.append(busy)
    keys = set.intersection(*map(set, shots))
    return channels({k: [s[k] for s in shots] for k in keys if len({s[k] for s in shots}) > 1}, active)


@pytest.mark.slow  # about 20 s: two scans of 8 windows
def test_no_number_a_sandbox_reads_moves_with_another_sandbox():
    sandbox.sandbox_mode()
    assert concurrent_scan() == {}
    assert later_scan() == {}


@pytest.mark.slow
def test_the_scan_finds_what_each_new_mask_hides(monkeypatch):
    """The control: with bubblewrap's /proc left in view (its vmstat is the host's; smaps counts who else maps a
    page of the sandbox root's files) and without the sysinfo, setsid, cookie and pipe rules, the scan names a
    channel behind each: the host's counters, the count of another sandbox's mappings, the inode number of a
    new pipe (one counter for the host), the sessions the writer made."""
    sandbox.sandbox_mode()
    monkeypatch.setattr(sandbox, "HIDE_PROC", False)
    dropped = ("sysinfo", "getsockopt", "setsid", "pipe", "pipe2")
    rules = tuple(r for r in sandbox.seccomp_rules() if r[0] not in dropped)
    monkeypatch.setattr(sandbox, "seccomp_rules", lambda: rules)
    found = concurrent_scan()
    # (a socket's cookie comes from a batch of numbers per CPU: the scan sees another sandbox take them only when
    # the two share a CPU, as it did on a loaded machine; its rule is held by tests/test_filter_rules.py)
    for hidden in ("/proc/vmstat:", "sysinfo:", "inode of a new pipe:"):
        assert any(k.startswith(hidden) for k in found), (hidden, sorted(found)[:30])
    assert any(re.search(r"/proc/P\d+/(smaps|numa_maps)", k) for k in found), sorted(found)[:30]
    assert any("/autogroup:" in k for k in later_scan())  # the sessions the writer made, counted

