"""tests/rank_server.py forks the test run's ranks as DeepSpeed's launcher starts them: what a rank sees is
what it sees under the `deepspeed` script, and a rank's failure is the launch's."""

import json
import subprocess

import pytest
from conftest import LAUNCHER, ROOT, cpu_env, deepspeed_run

pytestmark = pytest.mark.slow


def seen(out) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_forked_rank_sees_what_a_launched_one_sees(tmp_path):
    env = cpu_env(PROBE_MARK="x", OMP_NUM_THREADS="1")
    res = subprocess.run([*LAUNCHER, "--num_gpus", "2", "--master_port", "29681", "tests/launch_probe.py",
                          str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    real = seen(tmp_path)
    mine = deepspeed_run(2, "tests/launch_probe.py", str(tmp_path), port=29681, env=env)
    assert mine.returncode == 0, mine.stderr[-2000:]
    assert seen(tmp_path) == real
    assert [s["threads"] for s in real] == [1, 1] and real[1]["argv"][0] == "--local_rank=1"
    assert "rank 0 wrote" in mine.stdout and "rank 1 wrote" in mine.stdout


def test_a_failing_rank_fails_the_launch(tmp_path):
    res = deepspeed_run(2, "tests/launch_probe.py", str(tmp_path), port=29682, env=cpu_env(EXIT_CODE="3"))
    assert res.returncode == 3
    res = deepspeed_run(2, "tests/launch_probe.py", str(tmp_path / "missing"), port=29683)
    assert res.returncode == 1 and "FileNotFoundError" in res.stderr
