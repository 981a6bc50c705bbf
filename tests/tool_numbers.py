"""Each analysis tool's numbers on a run recorded with leave_one_out False, then True (tests/
test_tools_follow_the_trainer.py): length_drift's push, coupling and push with lengths shuffled, compare_rules'
step gradient on the lab policy, and whether bench_step's arguments carry the flag. Run from the project (or
fork) whose trainer is tested: python PATH/tool_numbers.py RUNS_DIR."""

import os
import sys

sys.path.insert(0, os.getcwd())  # the project run from, not this file's

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import train_grpo  # noqa: E402
from data.demo import model_dir  # noqa: E402
from scripts import bench_step, compare_rules, length_drift  # noqa: E402

out = {}
rewards = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0], dtype=torch.float64)
lengths = torch.tensor([5, 9, 12, 7, 20, 3, 8, 11, 6, 4, 9, 15, 5, 8, 30, 2])
model = AutoModelForCausalLM.from_pretrained(model_dir("lab"), dtype=torch.float32)
seqs = [(list(range(3, 7 + int(n))), 4) for n in lengths]
for loo in (False, True):
    run = Path(sys.argv[1]) / f"lab-token-loo{int(loo)}"
    run.mkdir()
    (run / "args.json").write_text(json.dumps({**vars(train_grpo.parse_args(["--model", "lab", "--agg", "token"])),
                                               "leave_one_out": loo}))
    args = length_drift.run_args(run)  # what every tool reads of a run
    grad = compare_rules.step_gradient(model, seqs, rewards, args)
    out[str(loo)] = [length_drift.hazard_push(rewards, lengths, args),
                     length_drift.coupling(rewards, lengths, args)[0],
                     length_drift.shuffled_push(rewards, lengths, args, draws=5),
                     float(sum(g.sum() for g in grad.values()))]
sys.argv = ["bench_step.py", "--update-only"]
out["bench_step"] = getattr(bench_step.parse_args(), "leave_one_out", None)
print(json.dumps(out))
