"""Paper-scale numerics that the CPU can still check: fp32 gradient accumulation under bf16 in the
DeepSpeed config the trainer builds (and that DeepSpeed's ZeRO-3 accepts it), and a warm-up whose
first update already has a learning rate."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, cpu_env

from grpo_utils.engines import jit_extensions_dir
from train_grpo import deepspeed_config, linear_warmup, parse_args

FLAGS = ["--model", "demo", "--prompts-per-step", "8", "--group-size", "4", "--minibatches", "2",
         "--micro-batch-size", "2"]


def test_bf16_config_accumulates_and_reduces_gradients_in_fp32():
    cfg = deepspeed_config(parse_args(FLAGS), world=2, bf16=True)
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["data_types"]["grad_accum_dtype"] == "fp32" and cfg["communication_data_type"] == "fp32"
    fp32 = deepspeed_config(parse_args(FLAGS), world=2, bf16=False)
    assert fp32["bf16"] == {"enabled": False} and "data_types" not in fp32


ZERO3_BF16 = """
import json, sys, torch, deepspeed
from transformers import AutoModelForCausalLM
deepspeed.init_distributed(dist_backend="gloo")
cfg = json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
for _ in range(cfg["gradient_accumulation_steps"]):
    ids = torch.randint(0, 100, (cfg["train_micro_batch_size_per_gpu"], 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
print(json.dumps({"types": [str(t) for t in engine.get_data_types()], "comm": str(engine.communication_data_type),
                  "accum": str(engine.optimizer.gradient_accumulation_dtype),
                  "grad_norm": float(engine.get_global_grad_norm()),
                  "optimizer": type(engine.optimizer.optimizer).__name__,
                  "fused": engine.optimizer.optimizer.defaults.get("fused")}))
"""


@pytest.mark.slow
def test_deepspeed_zero3_takes_the_bf16_config(demo_dir):
    # the CUDA configuration, optimizer included: torch's fused AdamW, no JIT-built FusedAdam
    cfg = deepspeed_config(parse_args(FLAGS), world=1, bf16=True)
    # DeepSpeed's CPU collectives op from this install's own build folder, as the trainer takes it: torch's
    # shared default is rebuilt (25 s) whenever another install built it last
    env = cpu_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29655",
                  TORCH_EXTENSIONS_DIR=jit_extensions_dir())
    res = subprocess.run([sys.executable, "-c", ZERO3_BF16, str(demo_dir / "model"), json.dumps(cfg)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["types"] == ["torch.bfloat16", "torch.float32"]
    assert out["accum"] == "torch.float32" and out["comm"] == "torch.float32" and out["grad_norm"] > 0
    assert out["optimizer"] == "AdamW" and out["fused"] is True


def test_optimizer_offload_keeps_deepspeeds_cpu_adam(tmp_path):
    ds = json.loads((ROOT / "ds_config.json").read_text())
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = deepspeed_config(parse_args([*FLAGS, "--ds-config", str(tmp_path / "ds.json")]), world=1, bf16=True)
    assert "torch_adam" not in cfg["optimizer"]["params"] and "fused" not in cfg["optimizer"]["params"]


def test_warmup_first_update_has_a_learning_rate():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    schedule = linear_warmup(4)(opt)
    used = []
    for _ in range(6):
        used.append(opt.param_groups[0]["lr"])  # the lr this update steps with
        opt.step()
        schedule.step()
    assert used == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
