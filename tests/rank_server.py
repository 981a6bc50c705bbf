"""The test run's ranks, forked from one process that imported the stack once (tests/conftest.deepspeed_run).

A launch through `deepspeed` starts every rank as a new Python that imports torch, transformers,
DeepSpeed and vLLM: about 8 s of CPU a rank, more than a short test run trains. This server makes
those imports once, as a CPU run of the trainer makes them (train_grpo.py's own import, which sets
vLLM's and torch's variables first), forgets the project's modules, and then forks each launch's ranks
as DeepSpeed's per-node launcher (deepspeed.launcher.launch) starts them: the launcher's variables,
`--local_rank=N` before the script's arguments, the test's environment and working directory, a rank
that fails ending the others, the first failure's code as the launch's. What a fork cannot inherit
is set as a fresh process sets it: torch's thread count from OMP_NUM_THREADS (OpenMP reads it when
torch loads). Fresh imports through the real `deepspeed` script and launcher stay with the tests that
need them: the crash test's killed launch, the lab's ablation, the two-node test, the GPU check.

    python tests/rank_server.py SOCKET     # one JSON request a connection; replies the launch's pid, then its code
"""

import atexit
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def warm_imports() -> None:
    """The trainer's imports, then its lazy ones (vLLM's engine, DeepSpeed, the model classes)."""
    sys.path.insert(0, str(ROOT))
    import deepspeed  # noqa: F401
    import torch
    import transformers  # noqa: F401
    import vllm  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    import evaluate  # noqa: F401
    import train_grpo  # noqa: F401

    if torch.cuda.is_initialized():  # a CUDA context does not survive a fork: say so, rather than hang a rank
        sys.exit("rank_server.py: the imports initialised CUDA; forked ranks need a CPU-only start")
    # the project's modules run afresh in every rank (their imports set the rank's own variables)
    for name, module in list(sys.modules.items()):
        file = str(getattr(module, "__file__", None) or "")
        if file.startswith(str(ROOT) + os.sep) and not file.startswith(sys.prefix + os.sep):
            del sys.modules[name]
    sys.path.remove(str(ROOT))


def run_rank(req: dict, rank: int) -> None:
    """One rank: as `python -u [-m] SCRIPT --local_rank=N ARGS` started by the launcher; never returns."""
    code = 1
    try:
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"], MASTER_ADDR="127.0.0.1", MASTER_PORT=str(req["port"]),
                          WORLD_SIZE=str(req["nproc"]), CROSS_RANK="0", CROSS_SIZE="1", LOCAL_SIZE=str(req["nproc"]),
                          RANK=str(rank), LOCAL_RANK=str(rank))
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or len(os.sched_getaffinity(0)))
        sys.argv = [req["script"], f"--local_rank={rank}", *req["args"]]
        if req["module"]:  # python -m MODULE: the working directory first on the path
            sys.path[0] = os.getcwd()
            runpy.run_module(req["script"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
            runpy.run_path(req["script"], run_name="__main__")
        code = 0
    except SystemExit as e:  # sys.exit(message) prints it, as the interpreter does
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code & 0xFF)


def launch(req: dict) -> None:
    """deepspeed.launcher.launch's loop: a rank that fails gets the others terminated (killed after 30 s)."""
    os.setsid()  # the launch and its ranks are one process group: a timeout kills them all
    ranks = {}
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            run_rank(req, rank)
        ranks[pid] = rank
    code = 0
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid, None)
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0 and code == 0:
            code = rc
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            deadline = time.time() + 30
            while ranks and time.time() < deadline:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid:
                    ranks.pop(pid, None)
                else:
                    time.sleep(0.1)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    os._exit(code & 0xFF)


def serve(path: str) -> None:
    warm_imports()
    server = socket.socket(socket.AF_UNIX)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the client waits for the socket's name: it appears ready
    server.listen(1)
    server.settimeout(2.0)
    parent = os.getppid()
    while os.getppid() == parent:  # the test run ended, killed or not: so does its server
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        with conn:
            req = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                launch(req)
            conn.sendall(f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os.unlink(path)
    os.rmdir(os.path.dirname(path))


if __name__ == "__main__":
    serve(sys.argv[1])
