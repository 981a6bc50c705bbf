"""The stdio case runner (rewards.run_cases): the response's program runs once per input, each as its own
process (own process group, limits, the sandbox's uid), its input a file and its output a FIFO of the sandbox's
own tmpfs (.io/stdin and .io/stdout, which /dev/stdin and /dev/stdout name), its stdout read up to the cap within
its wall time; each case's exit code and output go back on the runner's stdout, where the scorer compares them
(expected outputs never enter). No pipe, no memfd: their inodes are numbered from a counter of the whole host,
which any fstat reads (docs/rewards.md); the sandbox's own tmpfs numbers its files alone."""

import atexit
import os
import select
import signal
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the program's own folder off sys.path
from limit import limit, params, unpack  # noqa: E402

channel = os.dup(1)
inputs = unpack()  # held here only: a case sees its own input, never another's
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
uid = params["limits"][4]
same_user = uid < 0
if same_user:  # cases run as this user: make this process unreadable to them through /proc
    import ctypes
    prctl = ctypes.CDLL(None).prctl
    prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
os.makedirs(".io", 0o755, exist_ok=True)


def case_files(text):
    """.io/stdin, a file holding the case's input, readable and not writable by the case; .io/stdout, a FIFO (a
    pipe by its path: /dev/stdout opened by the program writes into it as into the pipe a harness hands), its
    reading end here. Both made anew for each case, in a directory only this runner writes (as root): a process
    of an earlier case still dying holds the old ones, not these."""
    for name in ("stdin", "stdout"):
        try:
            os.unlink(".io/" + name)
        except FileNotFoundError:
            pass
    fd = os.open(".io/stdin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    data = text.encode()
    while data:
        data = data[os.write(fd, data):]
    os.close(fd)
    os.mkfifo(".io/stdout", 0o600)
    if uid >= 0:
        os.chown(".io/stdout", uid, uid)
    r = os.open(".io/stdout", os.O_RDONLY | os.O_NONBLOCK)
    return os.open(".io/stdin", os.O_RDONLY), r, os.open(".io/stdout", os.O_WRONLY)


def run_main():
    # What `python main.py` does: the script as a fresh __main__ module, then the interpreter's exit
    # steps (wait for its threads, atexit, flush); its exit status.
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    code = 0
    try:
        with open("main.py", "rb") as f:
            exec(compile(f.read(), "main.py", "exec"), main.__dict__)
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:
        code = 1
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:
            pass
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
    except BaseException:
        code = code or 120
    return code & 0xFF if -2**63 <= code < 2**63 else 255


def run_case(text):
    fd_in, r, w = case_files(text)
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.setpgid(0, 0)  # a group of its own to kill (a session would be refused: sandbox.seccomp_rules)
            os.dup2(fd_in, 0)
            os.dup2(w, 1)
            os.closerange(3, 1 << 16)
            limit(*params["limits"])
            if same_user:
                prctl(4, 1, 0, 0, 0)
            sys.argv = ["main.py"]
            code = run_main()
        finally:
            os._exit(code)
    os.close(w)
    os.close(fd_in)
    deadline = time.monotonic() + params["timeout"]
    out, size, result = [], 0, None
    while result is None:
        left = deadline - time.monotonic()
        if left <= 0:
            result = (-9, b"", 1)
        elif select.select([r], [], [], left)[0]:
            try:
                data = os.read(r, 1 << 16)
            except BlockingIOError:
                continue
            size += len(data)
            if not data:
                break
            if size > params["cap"]:
                result = (-9, b"", 0)
            out.append(data)
    reaped = False
    while result is None:  # stdout closed: the exit status, within the same deadline
        reaped, status = os.waitpid(child, os.WNOHANG)
        if reaped:
            result = (os.waitstatus_to_exitcode(status), b"".join(out), 0)
        elif time.monotonic() >= deadline:
            result = (-9, b"", 1)
        else:
            time.sleep(0.001)
    os.close(r)
    try:
        os.killpg(child, signal.SIGKILL)  # the case and whatever it started
    except OSError:
        pass
    if not reaped:
        os.waitpid(child, 0)
    if params["mode"] != "rlimits":  # in its own PID namespace: whatever escaped the group goes too
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        try:  # where this runner is the namespace's init (unshare), the orphans are its to reap
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
    return result


for text in inputs:
    rc, out, timed_out = run_case(text)
    data = b"%d %d %d\n" % (rc, timed_out, len(out)) + out
    while data:
        data = data[os.write(channel, data):]
