"""The tools' rule-dependent numbers for one rule, and the same computed directly from its definition
w_i = 1 / (G sqrt(L_i)) (tests/test_fork_a_rule.py's rule foo). Run from the project (or fork) whose
trainer is tested: python PATH/rule_numbers.py RULE."""

import os
import sys

sys.path.insert(0, os.getcwd())  # the project run from, not this file's

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from scripts import length_drift  # noqa: E402
from scripts.ablation import rule_args  # noqa: E402

rule = sys.argv[1]
args = rule_args("lab", rule)  # as the ablation trains it: groups of 8, one mini-batch of 32 prompts
g = torch.Generator().manual_seed(0)
rewards = (torch.rand(64, generator=g) < 0.4).double()
lengths = torch.randint(3, 40, (64,), generator=g)
out = {"loss_scale": length_drift.loss_scale(rewards, lengths, args),  # sum_i w_i L_i of the step
       "direct": float(lengths.double().sqrt().mean()),  # mean_i sqrt(L_i): foo's sum_i w_i L_i
       "scale_free": length_drift.scale_free({"loss/pg": 0.3, "loss/token_weight": 1.5, "length/mean": 9.0}, args)}
try:  # a step logged before loss/token_weight: foo's scale is not a function of the mean length
    out["before_metric"] = length_drift.scale_free({"loss/pg": 0.3, "length/mean": 9.0}, args)
except ValueError as e:
    out["before_metric"] = str(e)
token = argparse.Namespace(**{**vars(args), "agg": "token"})
out["token_before_metric"] = length_drift.scale_free({"loss/pg": 0.3, "length/mean": 9.0}, token)
print(json.dumps(out))
