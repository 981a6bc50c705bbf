"""The gradient of one GRPO batch does not depend on the number of ranks or the micro-batch size."""

import json

import pytest
import torch
from conftest import deepspeed_run


@pytest.mark.parametrize("agg", ["seq", "token", "balanced"])
def test_gradient_same_for_1_rank_full_batch_and_2_ranks_micro_1(agg, demo_dir, tmp_path):
    model = str(demo_dir / "model")
    runs = {}
    for nproc, micro in ((1, 16), (2, 1)):
        out = tmp_path / f"delta_{nproc}_{micro}.pt"
        res = deepspeed_run(nproc, "tests/grad_probe.py", model, str(out), agg, str(micro))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs[nproc] = (torch.load(out), json.loads(out.with_suffix(".json").read_text())["loss"])
    (d1, loss1), (d2, loss2) = runs[1], runs[2]
    assert loss1 == pytest.approx(loss2, rel=1e-5, abs=1e-9)
    flat1 = torch.cat([d1[k].flatten() for k in sorted(d1)])
    flat2 = torch.cat([d2[k].flatten() for k in sorted(d2)])
    assert flat1.abs().max() > 1e-6  # the batch produced a real gradient
    torch.testing.assert_close(flat2, flat1, rtol=1e-4, atol=1e-7)
