"""Run one trainer update on a fixed GRPO batch and save the resulting parameter change.

Launched by tests/test_invariance.py as
    DS_ACCELERATOR=cpu deepspeed --num_gpus N tests/grad_probe.py MODEL OUT MICRO
With plain SGD (lr 1, no clipping) the change is exactly minus the gradient, so runs with
different rank counts and micro-batch sizes can be compared.
"""

import argparse
import gc
import math
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_grpo  # noqa: E402
from grpo_utils import batching, distributed  # noqa: E402


def fixed_batch(vocab: int, groups: int = 4, group_size: int = 4, seed: int = 0, zero_var: tuple = ()):
    """A GRPO batch of `groups` groups, negatives longer; the groups in `zero_var` all score the same."""
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    rewards = (torch.rand(groups * group_size, generator=g) < 0.5).double()
    for k in range(groups):  # mixed groups but those asked for
        if k in zero_var:
            rewards[k * group_size : (k + 1) * group_size] = rewards[k * group_size].item()
        else:
            rewards[k * group_size], rewards[k * group_size + 1] = 1.0, 0.0
    for i in range(groups * group_size):
        prompt = torch.randint(1, vocab, (5,), generator=g).tolist()
        n = int(torch.randint(2, 12, (1,), generator=g)) + (6 if rewards[i] == 0 else 0)  # negatives longer
        resp = torch.randint(1, vocab, (n,), generator=g).tolist()
        rollouts.append({"tokens": prompt + resp, "prompt_len": 5, "length": n, "truncated": False,
                         "score": rewards[i].item()})
    for r in rollouts:  # an off-policy sample so that clipping is exercised too
        r["old_logp"] = torch.full((r["length"],), -6.0) + 0.5 * torch.randn(r["length"], generator=g)
    return rollouts, rewards


def dealt_batch(vocab: int, rank: int, world: int, rounds: int, G: int = 4):
    """--dynamic-sampling's batch through the trainer's own functions: rounds of 4 groups (2 of the first
    round, 1 of the second score alike), each rank sampling its contiguous share of a round, the first 4
    mixed groups kept and dealt. Groups move between the ranks in both directions when world = 2."""
    held, kept = {}, []
    for rnd, zero_var in list(enumerate([(1, 3), (0,)]))[:rounds]:
        rollouts, _ = fixed_batch(vocab, 4, G, seed=10 + rnd, zero_var=zero_var)
        n = 4 // world
        first = rnd * 4 + rank * n
        kept += train_grpo.mixed_groups({first + j: rollouts[(rank * n + j) * G : (rank * n + j + 1) * G]
                                         for j in range(n)}, held)
    batch = train_grpo.deal_groups(held, kept, 4, 1, rank, world)
    adv = train_grpo.group_advantages(torch.tensor([r["score"] for r in batch], dtype=torch.float64), G)
    return batch, adv


CASES = [(agg, "ppo", 0) for agg in train_grpo.AGGS] + \
    [("balanced", loss, 0) for loss in ("gspo", "cispo", "sapo")] + [("balanced", "ppo", 2), ("token-batch", "ppo", 1)]
# with the optimizer offloaded, whose step reads the accumulation boundary: a per-response rule, a mini-batch
# rule, and dynamic sampling's boundaries set by hand (a policy loss does not touch the boundary)
OFFLOAD_CASES = [("seq", "ppo", 0), ("token-batch", "ppo", 0), ("balanced", "ppo", 2), ("token-batch", "ppo", 1)]
# with micro-batches cut by a token budget (--micro-batch-tokens) instead of MICRO: another partition per rank,
# and ranks whose counts differ until rank_micro_batches evens them out
TOKEN_CASES = [("balanced", "ppo", 0), ("token-batch", "ppo", 1)]
TOKENS = 34
# a batch whose groups' tokens are uneven across the ranks as sampled (seed 4: 131 against 107 tokens), trained
# as sampled ("-sampled") and with each mini-batch's groups dealt anew by their tokens ("-dealt": balance_ranks,
# as main does; 120 against 118)
DEALT_CASES = [("balanced", "ppo", 0), ("token-batch", "ppo", 0)]
UNEVEN_SEED = 4
# every rule under ppo with LoRA adapters of rank 2 on every linear layer (--lora-rank, the base frozen), their
# A and B random and the same on every rank (B = 0, as PEFT starts it, would leave A without a gradient)
LORA_CASES = [(agg, "lora", 0) for agg in train_grpo.AGGS]
# and through the padded path for one rule: the adapters wrap the linear layers, not the attention that packing
# changes (the rules' weights meet packing in CASES)
LORA_PADDED = [("balanced", "lora", 0)]


def case_name(agg: str, loss: str, rounds: int) -> str:
    """seq, gspo (under balanced), dynamic-2 / dynamic-1 (dynamic sampling over 2 rounds / 1 short round)."""
    return f"dynamic-{rounds}" if rounds else agg if loss == "ppo" else f"{agg}-lora" if loss == "lora" else loss


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # added by the launcher
    model_dir, out, micro = argv[0], Path(argv[1]), int(argv[2])
    distributed.start_deepspeed_comm(cuda=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM

    # every deepspeed.initialize below runs a full gc.collect (ZeRO-3's defragment): over the imported stack's
    # objects, 0.2 s each, 6 s a launch; they are here for good, so the collector skips them
    gc.freeze()
    results = {}
    # each rule, each policy loss, dynamic sampling, and some again with ZeRO-3's optimizer offloaded to
    # the CPU (its step reads the accumulation-boundary flag that DeepSpeed's backward prologue sets)
    # and every case again through the padded path (--padded), to hold packed rows to it
    runs = [(c, False, 0, False, False) for c in CASES] + [(c, True, 0, False, False) for c in OFFLOAD_CASES] + \
        [(c, False, TOKENS, False, False) for c in TOKEN_CASES] + [(c, False, 0, True, False) for c in CASES] + \
        [(c, False, 0, False, deal) for c in DEALT_CASES for deal in ("sampled", "dealt")] + \
        [(c, False, 0, False, False) for c in LORA_CASES] + [(c, False, 0, True, False) for c in LORA_PADDED]
    if rule := os.environ.get("GRAD_PROBE_RULE"):  # one rule's cases alone (tests/test_fork_a_rule.py's foo)
        runs = [r for r in runs if r[0][0] == rule and r[0][2] == 0 and r[0][1] in ("ppo", "lora")]
    for (agg, loss_name, rounds), offload, tokens, padded, dealt in runs:
        attention = batching.attention_implementation(argparse.Namespace(padded=padded, deterministic=False))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
        lora, key = loss_name == "lora", case_name(agg, loss_name, rounds)
        if lora:
            torch.manual_seed(0)
            model = train_grpo.with_adapters(model, 2, 4.0, init_lora_weights=False)
            loss_name = "ppo"
        G = 4
        if rounds:
            local, adv = dealt_batch(model.config.vocab_size, rank, world, rounds)
        else:
            rollouts, rewards = fixed_batch(model.config.vocab_size, seed=UNEVEN_SEED if dealt else 0)
            adv_all = train_grpo.group_advantages(rewards, G)
            n_local = len(rollouts) // world  # whole groups per rank
            local, adv = rollouts[rank * n_local : (rank + 1) * n_local], adv_all[rank * n_local : (rank + 1) * n_local]
        moved = 0
        if dealt == "dealt":
            mine = {id(r) for r in local}
            local, _ = batching.balance_ranks(local, G, 1, rank, world)
            moved = sum(id(r) not in mine for r in local)
            adv = train_grpo.group_advantages(torch.tensor([r["score"] for r in local], dtype=torch.float64), G)
        for r, a in zip(local, adv.tolist()):
            r["advantage"] = a
        n_local = 16 // world  # the engine's batch: a short dynamic-sampling step has fewer
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
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)  # LoRA: the adapters
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        prologues = []  # DeepSpeed's backward prologue must run on every micro-batch's backward
        real_prologue = engine._backward_prologue
        engine._backward_prologue = lambda: prologues.append(1) or real_prologue()
        eps = {"gspo": (0.05, 0.05), "cispo": (1.0, 0.5)}.get(loss_name, (0.2, 0.28))
        args = argparse.Namespace(
            # the micro-batches' sizes and rows (batching.micro_batching's) in the arguments here
            micro_batch_size=None if tokens else micro, logprob_batch_size=None if tokens else 4 * micro,
            micro_batch_tokens=tokens, pad_id=0, temperature=1.0, logprob_chunk=7, padded=padded, deterministic=False,
            policy_loss=loss_name,
            clip_eps_low=eps[0], clip_eps_high=eps[1], sapo_tau_pos=1.0, sapo_tau_neg=1.05, kl_coef=0.0,
            rollout_correction="none", rollout_correction_cap=2.0, mask_truncated=False, group_size=G, agg=agg,
            minibatches=1, max_response_len=17,
        )
        if loss_name != "ppo":  # ratios near 1 (the policy's own log-probs, perturbed): some clipped, some not
            train_grpo.fill_logprobs(engine, local, "old_logp", args, args, torch.device("cpu"))
            for r in local:  # the same noise for a response on any rank
                g = torch.Generator().manual_seed(hash(tuple(r["tokens"])) % 2**31)
                r["old_logp"] = r["old_logp"] + 0.3 * torch.randn(r["length"], generator=g)
        probe = [dict(r) for r in local]  # the per-token log-probs before the update (rank 0's share is saved)
        train_grpo.fill_logprobs(engine, probe, "logp", args, args, torch.device("cpu"))
        w = train_grpo.loss_weights(adv, local, args)  # the trainer's: a mean over this rank's groups
        sums = train_grpo.update_minibatch(engine, local, w, args, args, torch.device("cpu"))
        loss = torch.tensor([sums["pg_loss"]], dtype=torch.float64)
        dist.all_reduce(loss)
        loss /= world  # each rank's loss is the mean over its own groups
        delta = {}
        for name, p in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                delta[name] = (p.data - before[name]).clone()
        key += "-offload" if offload else "-tokens" if tokens else "-padded" if padded else f"-{dealt}" if dealt else ""
        parts = train_grpo.rank_micro_batches(local, args.micro_batch_size, tokens, not padded)
        own = batching.micro_batches([len(r["tokens"]) for r in local], None, tokens, packed=not padded)
        results[key] = {"delta": delta, "loss": loss.item(), "prologues": len(prologues),
                        "logp": torch.cat([r["logp"] for r in probe]), "padded": padded,
                        "micro_steps": len(parts) if tokens else math.ceil(len(local) / micro),
                        "responses": len(local) * world, "clipped": sums["clipped"],
                        "moved": int(distributed.all_reduce([moved]).item()),
                        "tokens": distributed.all_gather_objects(sum(len(r["tokens"]) for r in local)),
                        "evened": bool(distributed.all_reduce([tokens and len(own) != len(parts)], "max").item())}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()


if __name__ == "__main__":
    main()
    # past the interpreter's teardown of the process group, which gloo can abort ("terminate called without
    # an active exception"): every rank is past the last barrier and the results are on disk
    train_grpo.exit_without_teardown()
