"""Run one trainer update on a fixed GRPO batch and save the resulting parameter change.

Launched by tests/test_invariance.py as
    DS_ACCELERATOR=cpu deepspeed --num_gpus N tests/grad_probe.py MODEL OUT MICRO
With plain SGD (lr 1, no clipping) the change is exactly minus the gradient, so runs with
different rank counts and micro-batch sizes can be compared.
"""

import argparse
import math
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_grpo  # noqa: E402


def fixed_batch(vocab: int, groups: int = 4, group_size: int = 4) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rollouts = []
    rewards = (torch.rand(groups * group_size, generator=g) < 0.5).double()
    rewards[0], rewards[1] = 1.0, 0.0  # at least one mixed group
    for i in range(groups * group_size):
        prompt = torch.randint(1, vocab, (5,), generator=g).tolist()
        n = int(torch.randint(2, 12, (1,), generator=g)) + (6 if rewards[i] == 0 else 0)  # negatives longer
        resp = torch.randint(1, vocab, (n,), generator=g).tolist()
        rollouts.append({"tokens": prompt + resp, "prompt_len": 5, "length": n, "old_logp": None})
    adv = train_grpo.group_advantages(rewards, group_size)
    for r, a in zip(rollouts, adv.tolist()):
        r["advantage"] = a
        # an off-policy sample so that clipping is exercised too
        r["old_logp"] = torch.full((r["length"],), -6.0) + 0.5 * torch.randn(r["length"], generator=g)
    return rollouts, adv, torch.tensor([r["length"] for r in rollouts])


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # added by the launcher
    model_dir, out, micro = argv[0], Path(argv[1]), int(argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM

    results = {}
    # each rule, and each rule again with ZeRO-3's optimizer offloaded to the CPU (its step reads
    # the accumulation-boundary flag that DeepSpeed's backward prologue sets)
    for agg, offload in [(a, o) for o in (False, True) for a in ("seq", "token", "balanced", "balanced-batch")]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        rollouts, adv, lengths = fixed_batch(model.config.vocab_size)
        G = 4
        n_local = len(rollouts) // world  # whole groups per rank
        lo, hi = rank * n_local, (rank + 1) * n_local
        gas = math.ceil(n_local / micro)
        config = {
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "train_batch_size": micro * gas * world, "zero_optimization": {"stage": 3},
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
        }
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            config["zero_force_ds_cpu_optimizer"] = False  # plain SGD, so the update is minus the gradient
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        prologues = []  # DeepSpeed's backward prologue must run on every micro-batch's backward
        real_prologue = engine._backward_prologue
        engine._backward_prologue = lambda: prologues.append(1) or real_prologue()
        args = argparse.Namespace(
            micro_batch_size=micro, pad_id=0, temperature=1.0, logprob_chunk=7,
            clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0, rollout_correction="none", rollout_correction_cap=2.0,
            mask_truncated=False, group_size=G, agg=agg, minibatches=1,
        )
        for r in rollouts:
            r["truncated"] = False
        w = train_grpo.loss_weights(adv[lo:hi], rollouts[lo:hi], args)  # the trainer's: a mean over this rank's groups
        sums = train_grpo.update_minibatch(engine, rollouts[lo:hi], w, args, torch.device("cpu"))
        loss = torch.tensor([sums["pg_loss"]], dtype=torch.float64)
        dist.all_reduce(loss)
        loss /= world  # each rank's loss is the mean over its own groups
        delta = {}
        for name, p in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                delta[name] = (p.data - before[name]).clone()
        key = agg + ("-offload" if offload else "")
        results[key] = {"delta": delta, "loss": loss.item(), "prologues": len(prologues), "micro_steps": gas}
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
