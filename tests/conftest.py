import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The test run's sandboxes run as uids of their own (sandbox.SANDBOX_UIDS), so that a test that looks for
# leftover sandbox processes sees only the ones the test run started, not another test run's on the machine.
os.environ.setdefault("REWARDS_SANDBOX_UID_BASE", str(0x7F000000 + 65536 * secrets.randbelow(255)))
sys.path.insert(0, str(ROOT))
from sandboxed import sandbox  # noqa: E402  (after the uid range is chosen)

BENCHMARKS = ROOT / "data" / "benchmarks"  # the copies the project ships (sources and licences in its README)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    from data.demo import ensure_demo

    return ensure_demo()


# the environment before any test module imports train_grpo (whose import sets vLLM's variables for
# this process; a launched trainer must choose its own)
ENVIRON = dict(os.environ)


def cpu_env(**extra: str) -> dict:
    env = {k: v for k, v in ENVIRON.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


# DeepSpeed's launcher wherever DeepSpeed imports (its `deepspeed` script sits only in the bin/ of an
# environment DeepSpeed was pip-installed into)
LAUNCHER = [sys.executable, "-m", "deepspeed.launcher.runner"]


def deepspeed_run(nproc: int, script: str, *args: str, port: int = 29611, timeout: int = 600, env=None,
                  module: bool = False):
    """Run `deepspeed --num_gpus nproc [--module] script args` on the CPU accelerator; returns CompletedProcess.

    The ranks are forked, as DeepSpeed's per-node launcher would start them, from one server that
    imported the stack once for the test run (tests/rank_server.py): about 8 s of CPU a rank saved on
    every launch. Launches through the `deepspeed` script and LAUNCHER, fresh imports and all, are
    the crash test's, the lab's ablation, the two-node test's and tests/gpu_check.sh's."""
    import json
    import socket
    import tempfile

    cmd = ["deepspeed", "--num_gpus", str(nproc), "--master_port", str(port), *(["--module"] if module else []),
           script, *args]  # what it stands for
    with tempfile.TemporaryDirectory() as tmp, socket.socket(socket.AF_UNIX) as conn:
        req = dict(script=script, module=module, args=list(args), nproc=nproc, port=port, cwd=str(ROOT),
                   env=env or cpu_env(), stdout=f"{tmp}/stdout", stderr=f"{tmp}/stderr")
        conn.connect(rank_server())
        conn.sendall((json.dumps(req) + "\n").encode())
        reply = conn.makefile()
        pid = int(reply.readline())
        conn.settimeout(timeout)
        try:
            code = int(reply.readline())
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        read = lambda name: Path(tmp, name).read_text() if Path(tmp, name).exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(cmd, code, read("stdout"), read("stderr"))


@functools.cache
def _start_rank_server() -> tuple[subprocess.Popen, str]:
    import atexit
    import shutil
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="ranks-"), "socket")
    proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "tests" / "rank_server.py"), path], cwd=ROOT,
                            env=cpu_env(), stdin=subprocess.DEVNULL)
    atexit.register(lambda: (proc.kill(), shutil.rmtree(os.path.dirname(path), ignore_errors=True)))
    return proc, path


def rank_server() -> str:
    """The socket of the test run's rank server, started by the first launch (its imports: about 10 s)."""
    proc, path = _start_rank_server()
    deadline = time.time() + 300
    while not os.path.exists(path):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"tests/rank_server.py did not start (exit {proc.poll()})")
        time.sleep(0.1)
    return path


@pytest.fixture(scope="session")
def long_demo_model(demo_dir, tmp_path_factory) -> Path:
    """The demo model with a 4096-token context and a chat template, for real-length prompts: its
    byte-level tokenizer spells English at about one token per character (MATH-500 prompts are
    ~140 tokens, DAPO's ~450, LiveCodeBench's ~1400)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("models") / "demo-4k-chat"
    shutil.copytree(demo_dir / "model", model, ignore=shutil.ignore_patterns("eval"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    tok.save_pretrained(model)
    return model


def sandbox_processes() -> list[str]:
    """Processes of the test run's sandboxes (the uids conftest gave it) still running."""
    out = subprocess.run(["ps", "-eo", "uid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if int(line.split()[0]) in sandbox.SANDBOX_UIDS]


@pytest.fixture
def clean_machine():
    """After the test: none of the test run's sandbox processes left, no sandbox directory left."""
    before = set(os.listdir("/tmp"))
    pools = {p: set(os.listdir(p)) for p in Path("/tmp").glob("rewards-pool-*")}
    yield
    deadline = time.time() + 5  # a killed worker's sandbox dies with it, but not in the same instant
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.1)
    assert not sandbox_processes()
    assert not {f for f in set(os.listdir("/tmp")) - before if f.startswith("reward-")}
    for pool_dir in Path("/tmp").glob("rewards-pool-*"):  # the batch workers' (weaker modes only)
        assert not set(os.listdir(pool_dir)) - pools.get(pool_dir, set())
    # nor a sandbox's own tmpfs (root: sandbox._private_tmpfs), unmounted in the background once it ends
    while (sandbox_mounts() or sandbox_cgroups()) and time.time() < deadline + 5:
        time.sleep(0.1)
    assert not sandbox_mounts()
    assert not sandbox_cgroups()  # nor a sandbox's cgroup (root: sandbox._sandbox_cgroup), removed once empty


def sandbox_cgroups() -> list[str]:
    """The cgroups of the test run's sandboxes still there."""
    _, base = sandbox._memory_bound()
    return [os.path.join(base, name) for name in (os.listdir(base) if base else ())
            if name.isdigit() and int(name) in sandbox.SANDBOX_UIDS]


def sandbox_mounts() -> list[str]:
    """Mount points of the test run's sandboxes' tmpfs (the uids conftest gave it) still mounted."""
    root = sandbox._TMPFS_ROOT.rstrip("/") + "/"
    points = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    return [m for m in points if m.startswith(root) and m[len(root):].isdigit()
            and int(m[len(root):]) in sandbox.SANDBOX_UIDS]


@pytest.fixture
def path_without_bwrap(tmp_path) -> str:
    """A PATH with every program of the current one but bubblewrap (ninja, gcc, unshare stay)."""
    farm = tmp_path / "bin"
    farm.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if os.path.isdir(d):
            for name in os.listdir(d):
                if name != "bwrap" and not (farm / name).exists():
                    (farm / name).symlink_to(os.path.join(d, name))
    return str(farm)


def wandb_log(path: Path) -> dict:
    """{'run_id', 'config', 'history'} of an offline wandb run's transaction log (run-ID.wandb): the
    LevelDB log format, 32 KiB blocks of chunks with a 7-byte header (crc32, length, type), each whole
    record a protobuf wandb Record. wandb 0.31 has no Python reader of its own."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, chunks, records = path.read_bytes(), 32768, 7, b"", []  # 7: ':W&B', magic, version
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            records.append(pb.Record.FromString(chunks))
            chunks = b""

    def items(entries) -> dict:
        return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}

    run = next((r.run for r in records if r.WhichOneof("record_type") == "run"), None)
    assert run is not None, f"{path}: no run record (a log cut before wandb flushed it)"
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    return {"run_id": run.run_id, "config": {k: v["value"] if isinstance(v, dict) and "value" in v else v
                                             for k, v in items(run.config.update).items()}, "history": history}


def check_args(args, world: int) -> None:
    """flags.check_args with the trainer's tables, as train_grpo.checked_launch calls it."""
    import train_grpo
    from grpo_utils import flags

    flags.check_args(args, world, train_grpo.POLICY_LOSS_DEFAULTS[args.policy_loss], train_grpo.OFFLINE_DEFAULTS)


def check_output_dir(args, out_dir: Path, world: int) -> list[Path]:
    """run_dir.check_output_dir's checkpoints, with the trainer's defaults for this --model, as checked_launch
    calls it."""
    import train_grpo
    from grpo_utils import run_dir

    defaults = vars(train_grpo.parse_args(["--model", args.model]))
    return run_dir.check_output_dir(args, out_dir, world, defaults)[0]


def project_copy(tmp_path: Path, file: str, edits: list[tuple[str, str]]) -> Path:
    """A copy of the project (its data, sandbox and caches linked) with `file` edited as a forker would edit it:
    each (old, new) of `edits` replaces text found exactly once."""
    copy = tmp_path / "fork"
    shutil.copytree(ROOT, copy, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "runs", "data", "sandboxed", ".cache", "__pycache__", ".pytest_cache", ".ruff_cache"))
    for name in ("data", "sandboxed", ".cache"):
        if (ROOT / name).exists():
            (copy / name).symlink_to(ROOT / name)
    text = (copy / file).read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"the edit's anchor moved: {old[:60]!r}"
        text = text.replace(old, new)
    (copy / file).write_text(text)
    return copy
