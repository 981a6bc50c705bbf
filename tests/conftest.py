import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BENCHMARKS = ROOT.parent / "shared" / "benchmarks"


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    from data.demo import ensure_demo

    return ensure_demo()


def cpu_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def deepspeed_run(nproc: int, script: str, *args: str, port: int = 29611, timeout: int = 600, env=None):
    """Run `deepspeed --num_gpus nproc script args` on the CPU accelerator; returns CompletedProcess."""
    launcher = Path(sys.executable).parent / "deepspeed"
    cmd = [str(launcher), "--num_gpus", str(nproc), "--master_port", str(port), script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env or cpu_env(), capture_output=True, text=True, timeout=timeout)
