"""GRPO with seq / token / balanced loss aggregation, on vLLM + DeepSpeed ZeRO-3.

    deepspeed train_grpo.py --agg balanced --model Qwen/Qwen2.5-Math-7B \
        --dataset BytedTsinghua-SIA/DAPO-Math-17k --template dapo
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 train_grpo.py     # the offline demo

One step, top to bottom: the numbered sections of this file, and main()'s loop.
  1. rollout      every rank samples G responses for its share of the prompts with its own
                  colocated, in-process vLLM engine;
  2. reward       rule-based, verifiable (rewards.py);
  3. advantage    A_i = (r_i - mean_g) / (std_g + eps) within each group of G;
  4. aggregate    one weight w_i per response so that loss = sum_i w_i sum_t l_it over the
                  mini-batch (the paper's rules and the peer trainers', `aggregation_weights`);
  5. policy loss  PPO-clip (or GSPO, CISPO, SAPO) per token, l_it;
  6. update       ZeRO-3 backward and step per mini-batch, over packed micro-batches cut by a
                  token budget (each a row of whole sequences, attention confined to each);
  7. sync         gather ZeRO-3 partitions one parameter at a time into vLLM, in place.
Then the flags (arguments()), the engines, and main(). The run's plumbing (argument checks, the run
directory, checkpoints, the ranks and their collectives, packed micro-batches and the attention kernels,
memory sizing, metrics and loggers) is in grpo_utils/, one room a concern.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

# Engines run in this process (colocated), as RL trainers use them; must precede `import vllm`.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("DS_ACCELERATOR") == "cpu":
    # vLLM's CPU build warns about every missing GPU-side optimisation (Triton, tcmalloc, NUMA
    # binding): only errors, on the CPU; on GPUs its warnings are worth reading.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch is imported
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)  # logs before vLLM's logging is set up
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# CUDA: the update's freed blocks go back to the device in whole pages at torch.cuda.empty_cache(), however
# fragmented, so vLLM gets its share back when it wakes after an update (docs/gpu.md); vLLM's own sleep-mode pool
# turns them off inside it (device_allocator/cumem.py). Read at the first CUDA allocation: set before any.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op. is deprecated")

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from data.loading import load_data  # noqa: E402  (the model, tokenizer and prompts)

# the run's plumbing, one room a concern (grpo_utils/__init__.py)
from grpo_utils.batching import (  # noqa: E402
    attention_implementation,
    attention_kind,
    balance_ranks,
    micro_batches,
    micro_batching,
    model_inputs,
)
from grpo_utils.checkpoints import (  # noqa: E402
    damaged_shard,
    load_training_state,
    rng_state,
    run_complete,
    save_step,
    seed_rngs,
    set_rng_state,
)
from grpo_utils.common import first_line  # noqa: E402
from grpo_utils.distributed import (  # noqa: E402
    LAUNCH,
    all_gather_objects,
    all_reduce,
    ends_in_one_line,
    exit_without_teardown,
    init_distributed,
    make_deterministic,
    note_ranks,
    stop_after_bad_steps,
    stop_on_nonfinite_weights,
)
from grpo_utils.engines import check_jit_cache, deepspeed_config, jit_extensions_dir, linear_warmup, vllm_cpu_kwargs  # noqa: E402
from grpo_utils.flags import NO_BEFORE_VALUE, check_args, declare, flags_with, installed_versions, pin_mismatch  # noqa: E402
from grpo_utils.memory import device_fit, memory_to_update, states_to_come, trainer_memory  # noqa: E402
from grpo_utils.metrics import gpu_memory, model_flops_fn, open_loggers, resumable_values, step_metrics  # noqa: E402
from grpo_utils.run_dir import apply_recorded_sizes, check_output_dir, checked_sizes, device_record  # noqa: E402

os.environ.setdefault("TORCH_EXTENSIONS_DIR", jit_extensions_dir())  # a user's own choice is kept


# -----------------------------------------------------------------------------
# Hyperparameters. Defaults follow the DAPO recipe (clip-higher 0.2/0.28, lr 1e-6 with
# 10 warm-up steps, no KL, 16 responses per prompt, 512 prompts per step in 16
# mini-batches). `--model demo` switches to DEMO_DEFAULTS unless a flag is given. Every flag, with
# its default and help, is in arguments(), after the seven sections.


DEMO_DEFAULTS = dict(
    dataset="demo", eval_dataset="demo-test", template="plain", lr=2e-4, lr_warmup_steps=0,
    weight_decay=0.0, group_size=8, prompts_per_step=32, minibatches=1, micro_batch_size=64,
    max_prompt_len=32, max_response_len=12, steps=40, eval_interval=10, save_interval=20,
    eval_samples=4, eval_limit=200, output_dir="runs/demo",
)


# The aggregation lab (data/demo.py): the same task, with responses of 5-35 tokens whose failures
# ramble longer; output in runs/lab-AGG (or runs/lab-nogap-AGG), a checkpoint every 10 steps.
LAB_DEFAULTS = {**DEMO_DEFAULTS, "max_response_len": 48, "save_interval": 10, "output_dir": None}


OFFLINE_DEFAULTS = {"demo": DEMO_DEFAULTS, **{t: LAB_DEFAULTS for t in ("lab", "lab-nogap", "lab-nogap-hi", "lab-check",
                                                                        "lab-check-nogap")},
                    "lab-check-long": {**LAB_DEFAULTS, "max_response_len": 96}}  # loops of up to ~80 tokens


# the aggregation rules (aggregation_weights) and each policy loss's published defaults (policy_loss_per_token),
# applied to the flags left unset
AGGS = ["seq", "token", "balanced", "balanced-batch", "token-batch", "dr-grpo", "seq-sum"]


POLICY_LOSS_DEFAULTS = {
    "ppo": dict(clip_eps_low=0.2, clip_eps_high=0.28),  # DAPO's clip-higher
    "gspo": dict(clip_eps_low=3e-4, clip_eps_high=4e-4),  # GSPO's, on the sequence ratio
    # no lower bound (MiniMax-M1 tunes only the upper one and publishes no value); weight <= 5: TRL's cispo
    # value, from ScaleRL (arXiv 2510.13786); other trainers cap at 1.2-6. MiniMax-M1 pairs it with token-batch.
    "cispo": dict(clip_eps_low=1.0, clip_eps_high=4.0),
    "sapo": dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05),  # SAPO's gate temperatures
}


# -----------------------------------------------------------------------------
# 1. Rollout: G responses per prompt from this rank's colocated vLLM engine, with the log-probs it
# sampled them with; --dynamic-sampling keeps only groups whose scores differ.


def next_prompts(order: list[int], n_rows: int, n: int, seed: int, step: int) -> tuple[list[int], list[int]]:
    """This step's n prompts over all ranks and the order left: seeded epochs, the same on every rank."""
    while len(order) < n:
        epoch = list(range(n_rows))
        random.Random(seed + len(order) + step).shuffle(epoch)
        order = order + epoch
    return order[:n], order[n:]


def sampling_seed(seed: int, step: int, prompt_index: int, n: int) -> int:
    # vLLM gives the j-th of n samples seed+j, so per-prompt seeds are spaced by n.
    return ((seed * 100_003 + step) * 1_000_003 + prompt_index) * n % (2**31 - n)


def sampling_params(n: int, temperature: float, top_p: float, max_tokens: int, seed: int | None, step: int,
                    prompt_indices, logprobs: int | None = None) -> list:
    """One SamplingParams per prompt, seeded by the prompt's index in the whole set (sampling_seed):
    its samples do not depend on how the prompts are sharded over ranks or engines. The trainer's
    rollouts and evaluations and evaluate.py all sample through here. seed None: no per-request
    seed, the engine's own stream (--rollout-seed engine)."""
    from vllm import SamplingParams

    return [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=logprobs,
                           seed=None if seed is None else sampling_seed(seed, step, i, n)) for i in prompt_indices]


def generate(llm, rows: list[dict], params: list) -> list:
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in rows], params, use_tqdm=False)


def to_rollouts(rows: list[dict], outputs: list) -> list[dict]:
    """One record per sampled response, G consecutive per prompt; every field the step uses, set here or
    filled in later (None until then):

        row, text, prompt_len, tokens (prompt + response ids, vLLM's as returned), length (response tokens),
        truncated (stopped at --max-response-len), vllm_logp (the log-probs vLLM sampled with)
        score, reward            2. reward: the verifier's score; with the overlong penalty
        advantage                3. group advantages
        old_logp, ref_logp       6. the engine's log-probs before the update (and the KL reference's)
    """
    def vllm_logp(c) -> torch.Tensor | None:
        return torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]) if c.logprobs else None

    return [
        {"row": row, "text": c.text, "prompt_len": len(row["prompt_ids"]),
         "tokens": row["prompt_ids"] + list(c.token_ids), "length": len(c.token_ids),
         "truncated": c.finish_reason == "length", "vllm_logp": vllm_logp(c),
         "score": None, "reward": None, "advantage": None, "old_logp": None, "ref_logp": None}
        for row, o in zip(rows, outputs) for c in o.outputs
    ]


def rollout(llm, rows: list[dict], args, step: int, first_index: int) -> list[dict]:
    """G responses per prompt (prompt j of this rank is prompt first_index + j of the step), each
    token with the log-prob vLLM sampled it with."""
    seed = args.seed if args.rollout_seed == "request" else None
    params = sampling_params(args.group_size, args.temperature, args.top_p, args.max_response_len, seed,
                             step, range(first_index, first_index + len(rows)), logprobs=0)
    return to_rollouts(rows, generate(llm, rows, params))


def rollout_step(llm, train_rows: list[dict], order: list[int], args, step: int, rank: int, world: int,
                 timer: dict, reward_stats: dict, progress=None) -> tuple[list[dict], list[int], dict[str, float]]:
    """This rank's share of the step's groups, scored; the data order left; the sampling's metrics.

    One round: --prompts-per-step prompts P, prompt j of rank r being the step's prompt r P/world + j.
    --dynamic-sampling (DAPO): rounds of P fresh prompts (round k's prompt i has the index k P + i, so
    a round samples as a plain step would), keeping the groups whose scores are not all equal, until
    P are kept or --max-sample-rounds have run. The first P kept, in sampling order, are the step's,
    dealt to the ranks as a plain step's prompts are (deal_groups): which groups a step trains on does
    not depend on the number of ranks. None kept: the last round's groups, which carry no signal.
    progress(text): told the rounds so far and the groups kept, from the second round on.
    """
    P, G, n = args.prompts_per_step, args.group_size, args.prompts_per_step // world
    held, kept, correct = {}, [], 0.0
    for rnd in range(args.max_sample_rounds if args.dynamic_sampling else 1):
        t0 = time.time()
        batch_idx, order = next_prompts(order, len(train_rows), P, args.seed, step)
        first = rnd * P + rank * n
        rollouts = rollout(llm, [train_rows[i] for i in batch_idx[rank * n : (rank + 1) * n]], args, step, first)
        timer["rollout"] = timer.get("rollout", 0.0) + time.time() - t0
        t0 = time.time()
        score(rollouts, args, reward_stats)
        timer["reward"] = timer.get("reward", 0.0) + time.time() - t0
        if not args.dynamic_sampling:
            return rollouts, order, {}
        kept += mixed_groups({first + j: rollouts[j * G : (j + 1) * G] for j in range(n)}, held)
        correct += sum(r["score"] >= 1 for r in rollouts)
        if len(kept) >= P:
            break
        if progress is not None and rnd + 1 < args.max_sample_rounds:  # many rounds must not look like a hang
            progress(f"sampling round {rnd + 2}/{args.max_sample_rounds}, {len(kept)}/{P} groups kept")
    rounds, batch = rnd + 1, deal_groups(held, kept, P, args.minibatches, rank, world)
    accuracy = all_reduce([correct]).item() / (rounds * P * G)
    return batch or rollouts, order, {"sample/rounds": rounds, "sample/prompts": rounds * P,
                                      "sample/accuracy": accuracy, "sample/kept_share": len(kept) / (rounds * P),
                                      "sample/groups": len(batch) // G * world}


def mixed_groups(groups: dict[int, list[dict]], held: dict[int, list[dict]]) -> list[int]:
    """Every rank's ids of the groups whose scores are not all equal, in sampling order (one collective);
    this rank's such `groups` are added to `held`."""
    mixed = [gid for gid, g in groups.items() if len({r["score"] for r in g}) > 1]
    held.update((gid, groups[gid]) for gid in mixed)
    return sorted(gid for part in all_gather_objects(mixed) for gid in part)


def deal_groups(held: dict[int, list[dict]], kept: list[int], target: int, minibatches: int, rank: int,
                world: int) -> list[dict]:
    """This rank's contiguous block of the first `target` kept groups (`kept`: every rank's, in sampling
    order; fewer kept: the most that divide into ranks x mini-batches), [] for none. `held`: the kept
    groups this rank sampled; the others' come over in one collective."""
    k = min(target, len(kept)) // (world * minibatches) * (world * minibatches)
    if k == 0:
        return []
    share = k // world
    owner = {gid: i // share for i, gid in enumerate(kept[:k])}
    leaving = {gid: [{key: v for key, v in r.items() if key not in ("row", "text")} for r in g]
               for gid, g in held.items() if owner.get(gid, rank) != rank}
    arrived = {gid: g for part in all_gather_objects(leaving) for gid, g in part.items()}
    return [r for gid in kept[rank * share : (rank + 1) * share] for r in held.get(gid) or arrived[gid]]


# -----------------------------------------------------------------------------
# 2. Reward: rule-based and verifiable (rewards.py), DAPO's soft overlong penalty on top.


def overlong_penalty(length: int, max_len: int, buffer: int, alpha: float) -> float:
    """DAPO's soft overlong punishment: 0 up to L_max - L_buf tokens, then falling linearly to -alpha at
    L_max (--max-response-len; L_buf: --overlong-buffer, 0: off; alpha: --overlong-penalty)."""
    return -alpha * max(0, length - (max_len - buffer)) / buffer if buffer else 0.0


def score(rollouts: list[dict], args, stats: dict) -> None:
    """Each response's verifier score (rewards.py) and its reward: the score plus overlong_penalty."""
    from rewards import compute_rewards, reference

    scores = compute_rewards([r["text"] for r in rollouts], [reference(r["row"]) for r in rollouts],
                             [r["row"]["kind"] for r in rollouts], args.reward_workers, stats=stats,
                             code_partial=args.code_reward == "fraction")
    for r, s in zip(rollouts, scores):
        r["score"], r["reward"] = s, s + overlong_penalty(r["length"], args.max_response_len, args.overlong_buffer,
                                                          args.overlong_penalty)


# -----------------------------------------------------------------------------
# 3. Group advantages


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over each group of `group_size` consecutive responses."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def advantages(rewards: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """The run's advantages, as its flags ask: what the step and every analysis tool (with a run's recorded
    arguments) call, so that a change here reaches them all."""
    return group_advantages(rewards, args.group_size, scale_by_std=not args.no_std_norm)


# -----------------------------------------------------------------------------
# 4. Aggregation weights: the paper's rules and the peer trainers', one weight per response


def aggregation_weights(
    advantages: torch.Tensor, lengths: torch.Tensor, group_size: int, agg: str,
    batch: torch.Tensor | None = None, max_len: int | None = None,
) -> torch.Tensor:
    """Weights w_i with loss = sum_i w_i sum_t l_it over a mini-batch of groups of G responses.

    Every rule divides a response's token sum by a length n_i: w_i = 1 / (G n_i), averaged over the
    mini-batch's groups (a mean over its B / G groups: sum_i w_i sum_t l_it with w_i = 1 / (B n_i)).

    rule            n_i                                      the loss, l = l_it               as in
    seq             L_i                                      (1/G) sum_i (1/L_i) sum_t l      GRPO
    token           mean L of the group                      sum_i sum_t l / sum_i L_i        the paper's token-agg
    balanced        mean L of S_i, the response's sign       sum_S (|S|/G) sum_{i in S}       the paper
                    subset of its group: P (A>0), N (A<0),     sum_t l / sum_{i in S} L_i
                    Z (A=0)
    balanced-batch  mean L of the mini-batch's responses     balanced's balance in            this project
                    of S_i's sign, all ranks                   expectation, no length term
    token-batch     mean L of the mini-batch, all ranks      sum_i sum_t l / N, N tokens      verl token-mean, TRL dapo
    dr-grpo         L_max (max_len: --max-response-len)      sum_i sum_t l / (B L_max)        Dr. GRPO's normaliser
                                                                                                (verl, TRL); Dr. GRPO
                                                                                                with --no-std-norm
    seq-sum         1                                        sum_i sum_t l / B                verl seq-mean-token-sum

    `batch`: the mini-batch's `sign_lengths`, summed over ranks (default: these responses alone).
    A response of length 0 (empty, or masked by --mask-truncated) has no terms: w_i = 0; it adds no
    tokens to any sum and is no member of a sign subset (token-batch counts it in B, as N / B does).
    """
    A = advantages.view(-1, group_size)
    L0 = lengths.view(-1, group_size).to(torch.float64)
    L, kept = L0.clamp(min=1), L0 > 0  # clamp: only a masked response's own L, which gets no weight
    if agg == "seq":
        w = 1.0 / (group_size * L)
    elif agg == "token":
        w = (1.0 / L0.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(L)
    elif agg == "balanced":
        w = torch.zeros_like(L)
        for subset in (A > 0, A < 0, A == 0):
            members = subset & kept
            tokens = (L0 * members).sum(dim=1, keepdim=True).clamp(min=1)
            w = torch.where(members, members.sum(dim=1, keepdim=True) / (group_size * tokens), w)
    elif agg == "balanced-batch":
        w, stats = torch.zeros_like(L), sign_lengths(advantages, lengths) if batch is None else batch
        for subset, (tokens, responses, _) in zip((A > 0, A < 0, A == 0), stats.tolist()):
            w = torch.where(subset, 1.0 / (group_size * max(tokens / max(responses, 1), 1.0)), w)
    elif agg == "token-batch":
        stats = sign_lengths(advantages, lengths) if batch is None else batch
        w = torch.full_like(L, stats[:, 2].sum().item() / max(stats[:, 0].sum().item(), 1) / group_size)
    elif agg == "dr-grpo":
        if max_len is None:
            raise ValueError("dr-grpo needs max_len (--max-response-len)")
        w = torch.full_like(L, 1.0 / (group_size * max_len))
    elif agg == "seq-sum":
        w = torch.full_like(L, 1.0 / group_size)
    else:
        raise ValueError(f"unknown aggregation {agg!r}")
    w = torch.where(kept, w, 0.0)
    return (w / A.shape[0]).view(-1)  # mean over the groups of the mini-batch


def sign_lengths(advantages: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[[tokens, responses, responses with a masked one]] of the A>0, A<0 and A=0 responses; a masked
    (L=0) response is counted only in the last column. Summed over ranks: a mini-batch's statistics."""
    L, kept = lengths.to(torch.float64), lengths > 0
    return torch.tensor([[L[s & kept].sum().item(), (s & kept).sum().item(), s.sum().item()]
                         for s in (advantages > 0, advantages < 0, advantages == 0)], dtype=torch.float64)


def loss_weights(advantages: torch.Tensor, rollouts: list[dict], args) -> torch.Tensor:
    """Every w_i of this rank's rollout batch, all the normalisation in one place: the rule's weights
    (aggregation_weights; a truncated response under --mask-truncated counts as L_i = 0) over each
    mini-batch, whose -batch statistics are summed over ranks. Each rank takes the mean over its own
    groups; DeepSpeed's average of the gradients over ranks completes the mini-batch's mean (every
    rank holds as many groups).
    """
    lengths = torch.tensor([0 if args.mask_truncated and r["truncated"] else r["length"] for r in rollouts])
    per_mb = len(rollouts) // args.minibatches
    parts = [slice(k * per_mb, (k + 1) * per_mb) for k in range(args.minibatches)]
    # every mini-batch's statistics over all ranks, in one collective, whatever the rule: a rule reads them or not
    batch = all_reduce(torch.stack([sign_lengths(advantages[s], lengths[s]) for s in parts]))
    return torch.cat([aggregation_weights(advantages[s], lengths[s], args.group_size, args.agg, b,
                                          args.max_response_len) for s, b in zip(parts, batch)])


# -----------------------------------------------------------------------------
# 5. Policy loss per token: PPO-clip, GSPO, CISPO, SAPO; log-probs without a [tokens x vocab]
# float32 logits tensor


def response_mean(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each response's mean of the per-token x, repeated on its tokens (`lengths`: tokens of each, in order)."""
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths.to(x.device))
    total = torch.zeros(len(lengths), dtype=x.dtype, device=x.device).index_add(0, owner, x)
    return (total / lengths.to(x.device).clamp(min=1))[owner]


def rollout_correction(
    old_logp: torch.Tensor, vllm_logp: torch.Tensor, lengths: torch.Tensor, mode: str, cap: float
) -> torch.Tensor:
    """Per-token weights c_t for the rollout-trainer mismatch, rho_t = pi_old(y_t) / pi_vllm(y_t):

    token:    c_t = min(rho_t, C)                                  (truncated importance sampling)
    sequence: c_t = 1 if exp(mean_t log rho_t) is in [1/C, C], else 0, for all of a response's tokens
    none:     c_t = 1
    `lengths`: the tokens of each response, in order. No gradient flows through c.
    """
    log_rho = (old_logp - vllm_logp).detach()
    if mode == "token":
        return log_rho.exp().clamp(max=cap)
    if mode == "sequence":
        return (response_mean(log_rho, lengths).abs() <= math.log(cap)).to(log_rho.dtype)
    return torch.ones_like(log_rho)


def policy_loss_per_token(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float | None, eps_high: float | None,
    ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, correction: torch.Tensor | None = None,
    loss: str = "ppo", lengths: torch.Tensor | None = None, tau: tuple[float, float] = (1.0, 1.05),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """l_t for every response token: r = pi(y_t) / pi_old(y_t), A its response's advantage, c the rollout
    correction (default 1), sg() stop-gradient; `lengths` (tokens of each response, in order) for gspo.

    ppo    -c min(r A, clip(r, 1-eps_low, 1+eps_high) A)                        PPO-clip, clip-higher (DAPO)
    gspo   ppo with r replaced by s = sg(s_i) pi / sg(pi), s_i = exp(mean_t log r) of the response:
           value s_i, gradient s_i grad log pi; clipped per response             GSPO, arXiv 2507.18071
    cispo  -c sg(clip(r, 1-eps_low, 1+eps_high)) A pi / sg(pi): gradient -c r^ A grad log pi for every
           token, the importance weight clipped, never the token                CISPO, arXiv 2506.13585
    sapo   -c A ((4/tau) sigmoid(tau (r - 1)) + 1 - 2/tau), tau = tau_pos if A > 0 else tau_neg:
           a soft gate for the hard clip                                        SAPO, arXiv 2511.20347
    [+ beta k3(pi, ref)]

    On-policy (r = 1) every loss has the value -A and the gradient -A grad log pi: they differ only off
    the rollout policy. (pi / sg(pi) = 1 in value: cispo's value is -c r^ A, not TRL's -c r^ A log pi;
    sapo's constant 1 - 2/tau has no gradient; both keep loss/pg comparable across losses.)
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    if loss in ("ppo", "gspo"):
        r = ratio
        if loss == "gspo":
            r = torch.exp(response_mean(log_ratio, lengths).detach() + logp - logp.detach())
        loss_t = -torch.min(r * adv, r.clamp(1 - eps_low, 1 + eps_high) * adv)
        clipped = ((r < 1 - eps_low) & (adv < 0)) | ((r > 1 + eps_high) & (adv > 0))
    elif loss == "cispo":
        weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
        loss_t = -weight * adv * torch.exp(logp - logp.detach())
        clipped = (ratio < 1 - eps_low) | (ratio > 1 + eps_high)
    elif loss == "sapo":
        t = torch.where(adv > 0, tau[0], tau[1]).to(ratio.dtype)
        loss_t = -adv * ((4 / t) * torch.sigmoid(t * (ratio - 1)) + 1 - 2 / t)
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        raise ValueError(f"unknown policy loss {loss!r}")
    if correction is not None:
        loss_t = loss_t * correction
    stats = {"clipped": clipped, "approx_kl": (ratio - 1) - log_ratio}  # k3 estimate of KL(old || new)
    if ref_logp is not None:
        ref_kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3 of KL(pi || ref)
        loss_t = loss_t + kl_coef * ref_kl
        stats["ref_kl"] = ref_kl
    return loss_t, stats


def _chunk_logprobs(weight: torch.Tensor, bias, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)


def token_logprobs(
    engine, input_ids: torch.Tensor, response_mask: torch.Tensor, inputs: dict, temperature: float, chunk: int,
) -> torch.Tensor:
    """log pi(y_t | y_<t) for the response tokens (response_mask), flattened in row order; `inputs`: the
    model's other arguments for the rows (pack_batch's or pad_batch's)."""
    # The forward goes through the DeepSpeed engine, and the loss is built from its output: the
    # final (normed) hidden states, hidden_states[-1], with logits_to_keep=[] so that the model's
    # own lm_head runs on an empty slice (ZeRO-3 still gathers lm_head for that call; the logits
    # are computed in chunks below). DeepSpeed hooks that output, so its backward prologue runs
    # (ZeRO-3 gradient-accumulation bookkeeping, the accumulation-boundary flag offload reads).
    if "cu_seq_lens_q" in inputs:  # packed: a mask of None for each kind of layer, or transformers builds N x N ones
        kinds = getattr(engine.module.config, "layer_types", None) or ["full_attention"]
        inputs = {**inputs, "attention_mask": dict.fromkeys(kinds, None)}
    out = engine(input_ids=input_ids, **inputs, use_cache=False, output_hidden_states=True,
                 logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device))
    predict = response_mask[:, 1:]  # position t predicts token t+1 (of its own sequence: pack_batch)
    hidden = out.hidden_states[-1][:, :-1][predict]
    return chunked_logprobs(engine.module.lm_head, hidden, input_ids[:, 1:][predict], temperature, chunk)


def chunked_logprobs(
    lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int
) -> torch.Tensor:
    """log softmax(lm_head(h) / T)[target] for [N, H] hidden states, `chunk` rows at a time.

    With gradients on, each chunk is recomputed in backward (checkpointed), so peak memory
    holds one chunk's [chunk x vocab] float32 logits instead of all of them. All chunks run
    inside a single call of the lm_head module, so ZeRO-3 gathers its weight once for the
    forward and once for the backward, however many chunks there are (and every rank makes
    the same one call per micro-batch, whatever its token count).
    """
    def by_chunks(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = []
        for h_c, t_c in zip(h.split(chunk), t.split(chunk)):
            args = (lm_head.weight, lm_head.bias, h_c, t_c, temperature)
            if torch.is_grad_enabled():
                out.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False))
            else:
                out.append(_chunk_logprobs(*args))
        return torch.cat(out) if out else hidden.new_zeros(0)

    # the module's own hooks (ZeRO-3's gather and release) wrap this call; forward is swapped for it
    own = lm_head.__dict__.get("forward")
    lm_head.forward = by_chunks
    try:
        return lm_head(hidden, targets)
    finally:
        if own is None:
            del lm_head.forward
        else:
            lm_head.forward = own


# -----------------------------------------------------------------------------
# 6. Update: ZeRO-3 backward and step per mini-batch, over micro-batches cut by a token budget. A
# micro-batch is one packed row: its sequences back to back, each with its own positions from 0, and
# attention confined to each sequence by a variable-length kernel (no pad token is computed).


def rank_micro_batches(batch: list[dict], max_rows: int | None, max_tokens: int, packed: bool) -> list[list[int]]:
    """micro_batches of this rank's responses, as many on every rank (one all-reduce, only with a budget)."""
    lens = [len(r["tokens"]) for r in batch]
    parts = micro_batches(lens, max_rows, max_tokens, packed=packed)
    if max_tokens:
        parts = micro_batches(lens, max_rows, max_tokens, int(all_reduce([len(parts)], "max").item()), packed)
    return parts


@torch.no_grad()
def fill_logprobs(engine, rollouts: list[dict], key: str, args, batching, device) -> None:
    """r[key] = the engine's per-token log-probs of each response, --logprob-batch-size responses per forward.

    A forward-only pass keeps no activations for a backward, so it takes a larger batch than the
    update's micro-batch; under ZeRO-3 every forward gathers every parameter, so fewer passes
    gather less (docs/step_benchmark.md). Batches are bucketed by length and cut by the token budget (the
    update's: the hidden states of every layer are returned, as many bytes as the update's checkpoints).
    `batching`: the micro-batches' sizes and rows (micro_batching).
    """
    cut = rank_micro_batches(rollouts, batching.logprob_batch_size, batching.micro_batch_tokens, not batching.padded)
    for idx in cut:
        mb = [rollouts[i] for i in idx]
        ids, resp, inputs = model_inputs(mb, batching, device)
        lp = token_logprobs(engine, ids, resp, inputs, args.temperature, args.logprob_chunk).float().cpu()
        for r, x in zip(mb, lp.split([r["length"] for r in mb])):
            r[key] = x


def update_minibatch(engine, batch: list[dict], weights: torch.Tensor, args, batching, device) -> dict[str, float]:
    """Accumulate d/dtheta of sum_i w_i sum_t l_it over this rank's share of a mini-batch, then step.

    The weights (loss_weights) carry all the normalisation; `scale_wrt_gas=False` stops DeepSpeed
    from also dividing by the accumulation steps, so the gradient is the same for any number of
    ranks and any micro-batch size. Also sums, per token, the rollout-trainer mismatch between the
    log-probs vLLM sampled with and the trainer's before the update (`old`).
    """
    sums, skipped_before = defaultdict(float), engine.skipped_steps
    log_cap = math.log(args.rollout_correction_cap)
    parts = rank_micro_batches(batch, batching.micro_batch_size, batching.micro_batch_tokens, not batching.padded)
    for k, idx in enumerate(parts):
        mb = [batch[i] for i in idx]
        # the optimizer steps after the mini-batch's last micro-batch, however many a short step has
        engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
        ids, resp, inputs = model_inputs(mb, batching, device)
        logp = token_logprobs(engine, ids, resp, inputs, args.temperature, args.logprob_chunk)
        n_tok = torch.tensor([r["length"] for r in mb], device=device)
        per_token = lambda x: torch.repeat_interleave(x.to(device), n_tok)  # noqa: E731
        stored = lambda key: torch.cat([r[key] for r in mb]).to(device, logp.dtype)  # noqa: E731
        old = stored("old_logp") if mb[0]["old_logp"] is not None else logp.detach()
        vllm = stored("vllm_logp") if mb[0].get("vllm_logp") is not None else old
        ref = stored("ref_logp") if args.kl_coef > 0 else None
        adv = per_token(torch.tensor([r["advantage"] for r in mb], dtype=logp.dtype))
        w = per_token(weights[idx].to(logp.dtype))
        c = rollout_correction(old, vllm, n_tok, args.rollout_correction, args.rollout_correction_cap)
        loss_t, loss_stats = policy_loss_per_token(
            logp, old, adv, eps_low=args.clip_eps_low, eps_high=args.clip_eps_high, ref_logp=ref, kl_coef=args.kl_coef,
            correction=c, loss=args.policy_loss, lengths=n_tok, tau=(args.sapo_tau_pos, args.sapo_tau_neg))
        loss = (w * loss_t).sum()
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        gap = old - vllm  # log pi_old / pi_vllm on the tokens vLLM sampled
        loss_stats.update(mismatch_abs=gap.abs(), mismatch_kl=torch.expm1(gap) - gap, mismatch_out=gap.abs() > log_cap,
                  correction=c)  # mismatch_kl: k3 estimate of KL(pi_vllm || pi_old)
        sums["pg_loss"] += loss.item()
        sums["token_weight"] += w.sum().item()  # sum_i w_i L_i: the loss's scale (1 for a mean of token terms)
        sums["tokens"] += logp.numel()
        for k, v in loss_stats.items():
            sums[k] += v.float().sum().item()
    sums["grad_norm"] = float(engine.get_global_grad_norm() or 0.0)
    sums["micro_batches"] = len(parts)
    # DeepSpeed's own verdict: it skips the optimizer step when the gradient norm is not finite
    sums["skipped"] = engine.skipped_steps - skipped_before
    return sums


def update(engine, ref_engine, rollouts: list[dict], adv: torch.Tensor, args, batching, device, world: int,
           timer: dict) -> dict[str, float]:
    """Steps 4-6 on this rank's rollout batch: old log-probs (only when the policy moves between
    mini-batches; else the detached current ones) and reference ones (only with KL), the aggregation
    weights once, then one ZeRO-3 update per mini-batch of whole groups. This rank's sums for the metrics."""
    # No learning signal anywhere (every group has zero reward variance, no KL term): skip the log-prob passes and
    # the update rather than let AdamW's momentum and decay move the weights.
    learns = all_reduce([float(bool((adv != 0).any()) or args.kl_coef > 0)], op="max").item() > 0
    t0 = time.time()
    if args.minibatches > 1 and learns:
        fill_logprobs(engine, rollouts, "old_logp", args, batching, device)
    if ref_engine is not None and learns:
        fill_logprobs(ref_engine, rollouts, "ref_logp", args, batching, device)
    elif args.kl_coef > 0 and learns:  # LoRA: the reference is the frozen base, the policy with its adapters off
        with adapters_scaled_to_zero(engine.module):
            fill_logprobs(engine, rollouts, "ref_logp", args, batching, device)
    timer["logprobs"] = time.time() - t0
    t0 = time.time()
    engine.train()
    weights = loss_weights(adv, rollouts, args)
    sums, per_mb = defaultdict(float), len(rollouts) // args.minibatches
    for mb in range(args.minibatches if learns else 0):
        part = slice(mb * per_mb, (mb + 1) * per_mb)
        s = update_minibatch(engine, rollouts[part], weights[part], args, batching, device)
        bad = s.pop("skipped") > 0  # as DeepSpeed decided: the weights did not move
        for k, v in s.items():
            sums[k] += 0.0 if bad else v
        sums["skipped_updates"] += bad / world
        sums["updates"] += (not bad) / world
    timer["update"] = time.time() - t0
    return sums


# -----------------------------------------------------------------------------
# 7. Weight sync: ZeRO-3 partitions gathered one parameter at a time into vLLM, in place


def sync_weights_to_vllm(engine, llm) -> None:
    """Stream the trainer's weights into vLLM in place, one gathered ZeRO-3 parameter at a time.

    Each parameter is all-gathered (a collective: every rank walks the same order), handed
    to vLLM's loader under its Hugging Face name and released before the next one, so no
    rank ever holds a second full copy of the model. A sleeping engine (CUDA, after `rollout`)
    gets its weight memory back first and its KV cache after, once the update's cached blocks
    are returned to the device.
    """
    asleep = torch.cuda.is_available() and llm.llm_engine.is_sleeping()
    if asleep:
        torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    load_weights_into_vllm(llm, weights_iterator=policy_weights(engine))
    if asleep:
        torch.cuda.empty_cache()
        llm.wake_up(tags=["kv_cache"])


def policy_weights(engine):
    """(Hugging Face name, tensor) of every weight of the policy, gathered one ZeRO-3 parameter at a time (a
    collective: every rank walks the same order); under LoRA each adapted layer's merged W + (alpha / R) B A,
    the policy the trainer's forward computes, gathered one layer at a time. What vLLM samples from and the
    checkpoints export."""
    import deepspeed

    module = engine.module
    if not hasattr(module, "get_base_model"):  # full fine-tuning
        for name, param in module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                yield name, param.data
        return
    from peft.tuners.lora import LoraLayer

    seen, adapted = set(), None
    for prefix, layer in module.get_base_model().named_modules():
        if adapted and prefix.startswith(adapted):
            continue  # inside an adapted layer: its base weight and adapters, merged below
        if isinstance(layer, LoraLayer):
            adapted, (name,) = f"{prefix}.", layer.active_adapters
            base, a, b = layer.get_base_layer(), layer.lora_A[name].weight, layer.lora_B[name].weight
            with deepspeed.zero.GatheredParameters([base.weight, a, b]):
                delta = layer.scaling[name] * (b.data.float() @ a.data.float())  # fp32, then the base's dtype
                yield f"{prefix}.weight", (base.weight.data.float() + delta).to(base.weight.dtype)
            if base.bias is not None:
                with deepspeed.zero.GatheredParameters([base.bias]):
                    yield f"{prefix}.bias", base.bias.data
            continue
        for own, param in layer.named_parameters(recurse=False):
            if id(param) not in seen:  # a tied weight once, under its first name, as named_parameters gives it
                seen.add(id(param))
                with deepspeed.zero.GatheredParameters([param]):
                    yield f"{prefix}.{own}" if prefix else own, param.data


def load_weights_into_vllm(llm, weights_iterator=None, weights_path: str | None = None) -> None:
    """vLLM's in-place reload, from (HF name, tensor) pairs or from a checkpoint directory."""
    kwargs = {"weights_iterator": weights_iterator} if weights_iterator is not None else {"weights_path": weights_path}
    llm.collective_rpc("reload_weights", kwargs=kwargs)
    if not torch.cuda.is_available():
        llm.apply_model(_repack_cpu_lm_head)
    llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights


def _repack_cpu_lm_head(model: torch.nn.Module) -> None:
    # vLLM's CPU backend pre-packs every GEMM weight, lm_head's too. With tied embeddings the
    # reload only touches embed_tokens, leaving lm_head's packed copy stale: repack it.
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and hasattr(lm_head, "quant_method"):
        lm_head.quant_method.process_weights_after_loading(lm_head)


# -----------------------------------------------------------------------------
# The flags: every hyperparameter above and the run's own (model, data, lengths, intervals, memory), each
# declaring what it is to a run.


def arguments() -> argparse.ArgumentParser:
    """The trainer's flags, each with what it is to a run (run=, flags.FLAG_ROLES): "resume" may change on
    --resume, "launch" may differ between one run's launches, "device" defaults by the device, "size" is a
    micro-batch size. A flag declared with nothing is the run's identity: no launch may change it. bounds=(lo, hi,
    why): the closed range a float flag is checked against (flags.check_args), where float32 ends or use does."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def a(*names: str, run: str = "", before=NO_BEFORE_VALUE, bounds=None, **kw) -> None:
        declare(p.add_argument(*names, **kw), run.split(), before, bounds)

    a("--model", default="demo", help="HF model id or local dir; 'demo', 'lab', 'lab-nogap(-hi)': offline policies")
    a("--dataset", default="BytedTsinghua-SIA/DAPO-Math-17k", help="prepared .jsonl/.parquet, HF name, or 'demo'")
    a("--eval-dataset", run="resume", default=None, help="held-out prompts scored every --eval-interval steps")
    a("--template", default="dapo", choices=["plain", "chat", "boxed", "dapo"])
    a("--agg", default="balanced", choices=AGGS, help="loss aggregation rule (README's table; balanced-batch: this "
      "project's variant)")
    a("--policy-loss", default="ppo", choices=list(POLICY_LOSS_DEFAULTS),
      help="per-token surrogate: PPO-clip, GSPO, CISPO or SAPO (docs/workbench.md; each with its paper's defaults)")
    a("--group-size", type=int, default=16, help="G: responses sampled per prompt")
    a("--prompts-per-step", type=int, default=512, help="prompts per rollout batch, over all ranks")
    a("--minibatches", type=int, default=16, help="optimizer updates per rollout batch")
    a("--micro-batch-size", run="resume device size", type=int, default=None,
      help="responses per forward/backward per rank at most (default 4; with a token budget: no cap but it)")
    a("--micro-batch-tokens", run="launch size", type=int, default=None,
      help="tokens per forward/backward per rank: micro-batches of length-sorted responses filled up to it (default: "
           "on CUDA sized from the free memory at the first update by memory_model, recorded in the run; on the "
           "CPU 0 = off)")
    a("--padded", run="launch", action="store_true",
      help="right-padded micro-batches (rows x the longest count against the budget) instead of packed rows, "
           "for comparison (docs/gpu.md)")
    a("--lr", run="resume", type=float, default=1e-6)
    a("--lr-warmup-steps", run="resume", type=int, default=10, help="rollout steps of linear warm-up")
    a("--weight-decay", run="resume", type=float, default=0.1)
    a("--clip-eps-low", run="resume", type=float, default=None,
      help="ratio clip 1 - eps (default ppo 0.2, gspo 3e-4, cispo 1: none)")
    a("--clip-eps-high", run="resume", type=float, default=None,
      bounds=(0, 1e4, "a wider clip clips nothing more; 1 + eps must fit a float32 ratio"),
      help="ratio clip 1 + eps (default ppo 0.28, gspo 4e-4, cispo 4)")
    a("--sapo-tau-pos", run="resume", type=float, default=None,
      bounds=(1e-3, 1e3, "tau and 4 / tau scale float32 ratios"),
      help="SAPO's gate temperature where A > 0 (default 1.0)")
    a("--sapo-tau-neg", run="resume", type=float, default=None,
      bounds=(1e-3, 1e3, "tau and 4 / tau scale float32 ratios"),
      help="SAPO's gate temperature where A < 0 (default 1.05)")
    a("--lora-rank", type=int, default=0, help="R > 0: train LoRA adapters of rank R on every linear layer of the "
      "decoder (PEFT), the base frozen; vLLM samples the merged policy (docs/lora.md). 0: full fine-tuning")
    a("--lora-alpha", type=float, default=32.0,
      bounds=(1e-3, 1e4, "alpha / R scales the adapters' update, in the weights' dtype"),
      help="LoRA's update is (alpha / R) B A (32: LoRA Without Regret's, with which the best lr hardly moves with R)")
    a("--kl-coef", run="resume", type=float, default=0.0, bounds=(0, 1e4, "it scales float32 per-token terms"),
      help="k3 KL to a frozen reference; 0 = no reference model")
    a("--no-std-norm", action="store_true", help="A = r - mean (Dr. GRPO): do not divide by the group std")
    a("--max-prompt-len", type=int, default=1024, help="longer prompts are dropped (counted)")
    a("--max-response-len", run="resume", type=int, default=3072)
    a("--temperature", run="resume", type=float, default=1.0,
      bounds=(0.01, 100, "vLLM samples at 0.01 below it, and uniformly long before 100"))
    a("--top-p", run="resume", type=float, default=1.0)
    a("--steps", run="launch", type=int, default=500)
    a("--eval-interval", run="launch", type=int, default=25)
    a("--eval-samples", run="resume", type=int, default=8, help="k of the sampled Acc@k at evaluation")
    a("--eval-limit", run="resume", type=int, default=512, help="at most this many held-out prompts")
    a("--save-interval", run="launch", type=int, default=50, help="steps between checkpoints (full state + HF export)")
    a("--keep-last", run="launch", type=int, default=3,
      help="full training states kept, at least 1 (HF exports are all kept)")
    a("--resume", run="launch", action="store_true",
      help="continue from the latest checkpoint in --output-dir, which must hold one; may change the flags "
           "declared run=\"resume\" (lr, clip eps, temperature, ...)")
    a("--max-bad-steps", run="launch", type=int, default=5, help="consecutive non-finite steps before the run stops")
    a("--mask-truncated", action="store_true", help="no loss on responses cut at --max-response-len (DAPO)")
    a("--dynamic-sampling", action="store_true",
      help="DAPO: train only on groups whose scores differ, sampling further prompts in rounds to fill the step")
    a("--max-sample-rounds", type=int, default=10, help="--dynamic-sampling: rounds per step at most, then train on "
      "the groups kept")
    a("--overlong-buffer", type=int, default=0, help="DAPO's soft overlong penalty over the last N tokens before "
      "--max-response-len (0: off)")
    a("--overlong-penalty", type=float, default=1.0, help="its value at --max-response-len: -alpha",
      bounds=(0, 1e4, "the 0/1 scores must not vanish next to it in the reward"))
    a("--rollout-correction", default="none", choices=["none", "token", "sequence"],
      help="correct vLLM-vs-trainer mismatch: truncated importance weights per token, or a per-response mask")
    a("--rollout-correction-cap", run="resume", type=float, default=2.0,
      bounds=(1, 1e4, "a higher cap truncates nothing more; it must fit float32"),
      help="C: token weights min(ratio, C); mask [1/C, C]")
    a("--report-to", run="launch", nargs="+", default=["tensorboard"], choices=["tensorboard", "wandb"],
      help="metrics.jsonl always; TensorBoard (tb/) and/or wandb (WANDB_PROJECT, default balanced-grpo)")
    a("--peak-tflops", run="launch", type=float, default=None, bounds=(0, 1e6, "TFLOP/s of one device"),
      help="CUDA: the device's peak bf16 TFLOP/s for MFU (default: table)")
    a("--output-dir", run="launch", default=None, help="default runs/<model>-<agg>")
    a("--seed", type=int, default=42)
    a("--ds-config", default=str(ROOT / "ds_config.json"))
    a("--gradient-checkpointing", run="resume device", action=argparse.BooleanOptionalAction, default=None,
      help="recompute activations in backward (default: on with CUDA, where 7B activations do not fit without it)")
    a("--logprob-chunk", run="resume device", type=int, default=None,
      help="tokens per lm_head chunk in log-prob computation (default 1024 on CUDA, 256 on the CPU)")
    a("--logprob-batch-size", run="launch size", type=int, default=None,
      help="responses per forward-only pass (old and reference log-probs) per rank; default 4 x --micro-batch-size "
           "(with a token budget: no cap but it)")
    a("--deterministic", run="launch", action="store_true",
      help="bit-exact reruns of the update on CUDA: deterministic kernels, math attention (slower; docs/gpu.md)")
    a("--rollout-seed", default="request", choices=["request", "engine"],
      help="request: each prompt's samples seeded by (seed, step, prompt), whatever the sharding; engine: each "
           "engine's own stream, seeded by --seed + rank (docs/gpu.md)")
    a("--vllm-gpu-memory", run="launch", type=float, default=0.7,
      help="CUDA only: vLLM's share of GPU memory (docs/gpu.md)")
    a("--vllm-max-num-seqs", run="launch", type=int, default=256,
      help="CUDA only: sequences vLLM decodes at once per engine")
    a("--reward-workers", run="launch", type=int, default=4)
    a("--code-reward", before="fraction", default="all-pass", choices=["all-pass", "fraction"],
      help="code: 1 only when every test passes (default, as accuracy counts), or the fraction of stdio cases "
           "(docs/rewards.md)")
    a("--local_rank", run="launch", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = arguments()
    pre, _ = p.parse_known_args(argv)
    if pre.model in OFFLINE_DEFAULTS:
        p.set_defaults(**OFFLINE_DEFAULTS[pre.model])
    args = p.parse_args(argv)
    # the flags the command gives, as opposed to defaults: a run whose record predates a flag keeps the value
    # it was trained with unless it is given (before=), and a flag that needs another is refused alone
    unset = object()
    given = p.parse_args(argv, argparse.Namespace(**{action.dest: unset for action in p._actions}))
    args.flags_given = sorted(k for k, v in vars(given).items() if v is not unset)
    for k, v in POLICY_LOSS_DEFAULTS[args.policy_loss].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    cuda = torch.cuda.is_available()
    if args.logprob_chunk is None:  # [chunk x vocab] fp32 logits at a time: 0.6 GiB at 1024 x 152k
        args.logprob_chunk = 1024 if cuda else 256
    if args.micro_batch_tokens is None and not cuda:  # CUDA: sized once the engines hold their memory
        args.micro_batch_tokens = 0
    if args.micro_batch_size is None and args.micro_batch_tokens == 0:
        args.micro_batch_size = 4
    if args.logprob_batch_size is None and args.micro_batch_size is not None:
        args.logprob_batch_size = 4 * args.micro_batch_size  # no activations kept for a backward: more fit
    if args.output_dir is None:
        args.output_dir = f"runs/{Path(args.model).name}-{args.agg}"
    return args


# -----------------------------------------------------------------------------
# Engines and distributed set-up.


def checked_launch(argv: list[str] | None) -> tuple[argparse.Namespace, int, dict, list[Path]]:
    """(arguments, ranks, DeepSpeed config, checkpoints to resume from, newest first), every argument
    and the run directory checked before any process group or engine starts; one line and exit if not."""
    args = parse_args(argv)
    if args.deterministic:
        make_deterministic()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0 and (line := pin_mismatch(installed_versions())):
        print(line, flush=True)
    try:
        check_args(args, world, POLICY_LOSS_DEFAULTS[args.policy_loss], OFFLINE_DEFAULTS)
        ds_config = deepspeed_config(args, world)
        defaults = vars(parse_args(["--model", args.model]))  # what a run predating a flag was trained with
        checkpoints, as_trained = check_output_dir(args, Path(args.output_dir), world, defaults)
        if checkpoints:  # what a resume applies of it, checked as the flags were (resume checks a fallback's)
            recorded_sizes(checkpoints[0], args, world)
        check_jit_cache(ds_config, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as e:
        sys.exit(f"train_grpo.py: error: {e}")
    return argparse.Namespace(**{**vars(args), **as_trained}), world, ds_config, checkpoints


def build_trainer(args, model_path: str, ds_config: dict):
    """The ZeRO-3 policy engine and the frozen reference engine (only with --kl-coef); no vLLM."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cuda = torch.cuda.is_available()
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841  (makes from_pretrained load partitioned)
    dtype = torch.bfloat16 if cuda else torch.float32
    attention = {"attn_implementation": attention_implementation(args)}
    try:
        policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **attention)
    except Exception as e:  # a damaged or missing weights file, of whatever error type the loader raises
        sys.exit(f"train_grpo.py: error: cannot load the model from {model_path} ({first_line(e)})")
    if args.lora_rank:
        policy = with_adapters(policy, args.lora_rank, args.lora_alpha)
    if args.gradient_checkpointing or (args.gradient_checkpointing is None and cuda):
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # transformers then makes the embedding's output require grad, which reentrant checkpoints need; these are
        # not, and with LoRA's frozen embedding it would make, and keep through the step, a [tokens x hidden]
        # gradient of that output
        policy.disable_input_require_grads()
    # warm-up over --lr-warmup-steps rollout steps, unless the DeepSpeed config brings its own schedule
    warmup = args.lr_warmup_steps * args.minibatches
    schedule = linear_warmup(warmup) if warmup > 0 and "scheduler" not in ds_config else None
    trained = [p for p in policy.parameters() if p.requires_grad]  # the optimizer holds these (LoRA: the adapters)
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=trained, config=ds_config, lr_scheduler=schedule)
    ref_engine = None
    if args.kl_coef > 0 and not args.lora_rank:  # LoRA's reference is its own base, its adapters off (update)
        ref_cfg = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **attention).eval()
        ref_engine = deepspeed.initialize(model=ref, config=ref_cfg)[0]
    return engine, ref_engine


def with_adapters(policy, rank: int, alpha: float, **lora):
    """The policy with LoRA adapters (PEFT) on every linear layer of the decoder, W + (alpha / R) B A with the base
    frozen; B = 0 at first (the base policy) unless `lora` (more of LoraConfig's fields) says otherwise. The
    adapters in the weights' dtype, as every other trained weight (bf16 on CUDA, DeepSpeed's fp32 master copies
    beside them), not PEFT's fp32, which would cast each adapted layer's input to a saved fp32 copy."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", **lora)
    return get_peft_model(policy, config, autocast_adapter_dtype=False)


@contextlib.contextmanager
def adapters_scaled_to_zero(policy):
    """The frozen base through the policy's own modules: W x + 0 (B A x) adds exact zeros, so the log-probs are the
    base's, while lora_A and lora_B still run in their order. PEFT's disable_adapter skips them, and ZeRO-3, which
    records the modules' order to prefetch their parameters, would find another order and drop its record every
    step."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
    scales = [dict(m.scaling) for m in layers]
    for m in layers:
        m.scaling.update(dict.fromkeys(m.scaling, 0.0))
    try:
        yield
    finally:
        for m, scale in zip(layers, scales):
            m.scaling.update(scale)


def make_vllm(model_path: str, args, rank: int, local_rank: int, pending_states: float = 0.0):
    """This rank's colocated vLLM engine. CUDA: its share (--vllm-gpu-memory) must be free now and again when it
    wakes after the first update, by which time the trainer also holds `to_come` (Adam's moments)."""
    from transformers import AutoConfig
    from vllm import LLM

    # Expected at every sync, not a failure: rotary embeddings have no weights, and a tied
    # lm_head receives its weights through embed_tokens. An untied lm_head that fails to load
    # is a real failure and stays visible.
    expected = {"RotaryEmbedding: Failed to load weights"}
    if getattr(AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False):
        expected.add("ParallelLMHead: Failed to load weights")
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: record.getMessage() not in expected)

    max_len = args.max_prompt_len + args.max_response_len
    cuda = torch.cuda.is_available()
    kw = dict(gpu_memory_utilization=args.vllm_gpu_memory, max_num_seqs=args.vllm_max_num_seqs,
              enable_sleep_mode=True, dtype="bfloat16") if cuda else vllm_cpu_kwargs(max_len)
    if cuda:  # vLLM starts only if its whole share is free now (v1/worker/utils.py: request_memory), and wakes
        # after an update only if it is free again, beside Adam's moments
        free, total = torch.cuda.mem_get_info()
        room = free - pending_states
        stop_all(f"rank {rank}: --vllm-gpu-memory {args.vllm_gpu_memory} asks for "
                 f"{args.vllm_gpu_memory * total / 2**30:.1f} GiB of cuda:{local_rank}, {room / 2**30:.1f} GiB stay "
                 f"free beside the trainer's ZeRO-3 states and Adam's moments ({pending_states / 2**30:.1f} GiB, made "
                 f"at the first step): lower it to {max(room / total - 0.03, 0):.2f}, use more GPUs or optimizer "
                 "offload (docs/gpu.md)" if room < args.vllm_gpu_memory * total else None)
    # external_launcher: one engine per launched rank, on the device of LOCAL_RANK, inside the
    # launcher's process group (CPU and CUDA alike). vLLM's default uniprocess executor would put
    # every rank's engine on cuda:0 and move the rank's current device there.
    # processed_logprobs: a sampled token's log-prob as sampled, after temperature (and top-p renormalisation)
    llm = LLM(model=model_path, max_model_len=max_len, seed=args.seed + rank, tensor_parallel_size=1,
              distributed_executor_backend="external_launcher", use_tqdm_on_load=False,
              logprobs_mode="processed_logprobs", **kw)
    moved = cuda and torch.cuda.current_device() != local_rank
    stop_all(f"rank {rank}: vLLM's engine moved the current CUDA device to cuda:{torch.cuda.current_device()}, "
             f"not cuda:{local_rank} (LOCAL_RANK)" if moved else None)
    if cuda and rank == 0 and args.rollout_seed == "request" and not llm.llm_engine.vllm_config.use_v2_model_runner:
        print("[grpo] vLLM runs its V1 model runner, whose sampler loops in Python over every seeded request at "
              "every decode step: --rollout-seed engine avoids it (docs/gpu.md)", flush=True)
    return llm


def stop_all(problem: str | None) -> None:
    """Every rank stops with the first rank's problem, if any rank has one (a collective: all ranks call it)."""
    errors = [e for e in all_gather_objects(problem) if e]
    if errors:
        sys.exit(f"train_grpo.py: error: {errors[0]}")


def build_engines(args, model_path: str, ds_config: dict, rank: int, local_rank: int):
    """The ZeRO-3 policy engine, the frozen reference engine (only with --kl-coef), the vLLM engine."""
    engine, ref_engine = build_trainer(args, model_path, ds_config)
    pending_states = 0.0
    if torch.cuda.is_available():
        longest = args.max_prompt_len + args.max_response_len
        pending_states = states_to_come(engine, trainer_memory(engine, args, longest, attention_kind(args, cuda=True)))
    return engine, ref_engine, make_vllm(model_path, args, rank, local_rank, pending_states)


def recorded_sizes(ckpt: Path, args, world: int) -> dict:
    """The micro-batch sizes and device `ckpt` recorded (its trainer_state.json's "sizes", {} before the record),
    checked as this launch's flags are: by this parser and check_args (run_dir.checked_sizes); a ValueError names
    the file and the key."""
    path = ckpt / "trainer_state.json"
    return checked_sizes(json.loads(path.read_text()).get("sizes", {}), path,
                         parse=lambda flags: parse_args(["--model", args.model, *flags]),
                         check=lambda values: check_args(argparse.Namespace(**{**vars(args), **values}), world,
                                                         POLICY_LOSS_DEFAULTS[args.policy_loss], OFFLINE_DEFAULTS))


def resumed_batching(args, tokenizer, resumed: Path | None, world: int, this_device: dict, rank: int
                     ) -> tuple[argparse.Namespace, int | None]:
    """How the update cuts its micro-batches (micro_batching: what the run learns of them lives there,
    not in args), with the sizes the checkpoint resumed from recorded where they apply, and the cap on a token
    budget measured anew (apply_recorded_sizes). The record is checked at the launch, and here again where the
    resume fell back to an older checkpoint: a damaged one is one line."""
    try:
        recorded = recorded_sizes(resumed, args, world) if resumed else {}
    except ValueError as e:
        sys.exit(f"train_grpo.py: error: {e}")
    batching = micro_batching(args, tokenizer)
    return batching, apply_recorded_sizes(batching, args.flags_given, recorded, this_device, resumed, rank)


def resume(engine, llm, checkpoints: list[Path], rank: int, args) -> tuple[int, list[int], int, Path | None]:
    """(step, prompt order, bad-step streak, the checkpoint) of the newest checkpoint every rank can load, weights
    synced into vLLM; (0, [], 0, None) for a new run. One whose files fail their CRC on any rank: the one before."""
    for ckpt in checkpoints:  # newest first
        errors = [e for e in all_gather_objects(damaged_shard(ckpt, rank)) if e]
        if not errors:
            state = load_training_state(engine, ckpt, rank, args)
            sync_weights_to_vllm(engine, llm)
            if rank == 0:
                print(f"[grpo] resuming from {ckpt} (step {state['step']})", flush=True)
            return state["step"], state["order"], state["bad_streak"], ckpt
        if rank == 0:
            print(f"[grpo] {errors[0]}: " + ("falling back to the previous checkpoint" if ckpt != checkpoints[-1]
                                             else "no earlier checkpoint"), flush=True)
    if checkpoints:
        sys.exit(f"train_grpo.py: error: no checkpoint of {checkpoints[0].parent} could be loaded; "
                 "repair the named file, or use another --output-dir")
    return 0, [], 0, None


def evaluation_samples(llm, rows: list[dict], prompt_indices: list[int], n: int, temperature: float, top_p: float,
                       max_tokens: int, seed: int, step: int, workers: int
                       ) -> tuple[list[list[str]], list[list[float]]]:
    """n responses to each row's prompt_ids and their rewards, per row: the one evaluation path of the
    trainer's in-loop evaluation and of evaluate.py."""
    from rewards import compute_rewards, reference

    outs = generate(llm, rows, sampling_params(n, temperature, top_p, max_tokens, seed, step, prompt_indices))
    texts = [[c.text for c in o.outputs] for o in outs]
    flat = compute_rewards([t for ts in texts for t in ts], [reference(r) for r in rows for _ in range(n)],
                           [r["kind"] for r in rows for _ in range(n)], workers)
    return texts, [flat[j * n : (j + 1) * n] for j in range(len(rows))]


def evaluate_held_out(llm, rows: list[dict], args, rank: int, world: int, step: int, out_dir: Path) -> dict[str, float]:
    """Greedy accuracy and sampled Acc@k on this rank's shard of the held-out prompts."""
    shard, idx, k = rows[rank::world], list(range(rank, len(rows), world)), args.eval_samples
    greedy = dict(n=1, temperature=0.0, top_p=1.0, seed=0, step=0)  # one answer per prompt, the same every time
    g_text, g_score = evaluation_samples(llm, shard, idx, **greedy, max_tokens=args.max_response_len,
                                         workers=args.reward_workers)
    _, s_score = evaluation_samples(llm, shard, idx, n=k, temperature=args.temperature, top_p=args.top_p,
                                    max_tokens=args.max_response_len, seed=args.seed + 1, step=step,
                                    workers=args.reward_workers)
    t = all_reduce([sum(x[0] for x in g_score), sum(map(sum, s_score)), len(shard), k * len(shard)])
    samples = [{"id": r["id"], "answer": r.get("answer"), "greedy": txt[0], "score": sc[0]}
               for r, txt, sc in zip(shard, g_text, g_score)]
    gathered = all_gather_objects(samples)
    if rank == 0:
        (out_dir / "eval").mkdir(parents=True, exist_ok=True)
        with open(out_dir / "eval" / f"step_{step:06d}.jsonl", "w") as f:
            for part in gathered:
                for s in part:
                    f.write(json.dumps(s) + "\n")
    return {"eval/acc_greedy": (t[0] / t[2]).item(), f"eval/acc@{k}": (t[1] / t[3]).item()}


@ends_in_one_line(lambda argv: parse_args(argv).output_dir)
def main(argv: list[str] | None = None) -> None:
    args, world, ds_config, checkpoints = checked_launch(argv)
    out_dir = Path(args.output_dir)
    rank, local_rank = init_distributed(out_dir, checkpoints, world)
    note_ranks(out_dir, rank)  # a rank that dies without a word is named by the others
    import torch.distributed as dist
    from tqdm import tqdm

    if run_complete(checkpoints, args.steps, out_dir, rank):  # said without starting any engine
        dist.destroy_process_group()  # no engine holds it: left to the interpreter's exit, gloo can abort there
        return
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    seed_rngs(args.seed + rank)
    model_path, tokenizer, train_rows, dropped, eval_rows = load_data(args, local_rank)
    rng_before_vllm = rng_state()
    if cuda:
        stop_all(device_fit(args, model_path, ds_config, world, local_rank, attention_kind(args, cuda=True)))
    engine, ref_engine, llm = build_engines(args, model_path, ds_config, rank, local_rank)
    set_rng_state(rng_before_vllm)  # vLLM's worker reseeded Python, NumPy and torch (gpu_worker.py: set_random_seed)
    start, order, bad_streak, resumed = resume(engine, llm, checkpoints, rank, args)
    this_device = device_record(cuda, local_rank, args.vllm_gpu_memory)
    batching, budget_cap = resumed_batching(args, tokenizer, resumed, world, this_device, rank)
    if rank == 0:
        print(f"[grpo] {len(train_rows)} training prompts ({dropped[0]} too long, dropped), "
              f"{len(eval_rows)} eval prompts ({dropped[1]} too long, dropped), {world} ranks, agg={args.agg}, "
              f"policy loss {args.policy_loss} ("
              + ", ".join(f"{k} {getattr(args, k)}" for k in POLICY_LOSS_DEFAULTS[args.policy_loss]) + ")", flush=True)
    log, close_loggers = open_loggers(args, out_dir, rank, start)
    model_flops, peak = model_flops_fn(engine, args.peak_tflops)
    if eval_rows and start == 0:
        ev = evaluate_held_out(llm, eval_rows, args, rank, world, 0, out_dir)
        log(0, ev)
        if rank == 0:
            print("[grpo] step 0 eval: " + "  ".join(f"{k} {v:.3f}" for k, v in ev.items()), flush=True)

    metrics = {}
    bar = tqdm(range(start + 1, args.steps + 1), desc=f"grpo[{args.agg}]", disable=rank != 0, dynamic_ncols=True,
               initial=start, total=args.steps)
    for step in bar:
        LAUNCH["step"] = step  # a rank that dies is named with it
        timer, reward_stats = {}, {}
        # 1-2. rollout and reward: this rank's share of the step's prompts, G scored responses each
        rollouts, order, sampling = rollout_step(llm, train_rows, order, args, step, rank, world, timer, reward_stats,
                                                 lambda text: bar.set_postfix_str(text, refresh=True))
        reward_stats["generated"] = sum(r["length"] for r in rollouts)  # this rank's, before some move to another
        rollouts, balance = balance_ranks(rollouts, args.group_size, args.minibatches, rank, world)
        if cuda and (budget := memory_to_update(llm, engine, args, batching, rank, budget_cap)) is not None:
            batching.micro_batch_tokens = budget  # --micro-batch-tokens, measured: recorded with the checkpoints

        # 3. advantages within each group
        adv = advantages(torch.tensor([r["reward"] for r in rollouts], dtype=torch.float64), args)
        for r, a in zip(rollouts, adv.tolist()):
            r["advantage"] = a

        # 4-6. aggregation weights once per rollout batch; per-token policy loss; ZeRO-3 update per mini-batch
        lr = engine.get_lr()[0]  # of this step's first update
        sums = update(engine, ref_engine, rollouts, adv, args, batching, device, world, timer)
        memory = gpu_memory() if cuda else None
        metrics = {**step_metrics(rollouts, sums, reward_stats, timer, args, world, model_flops, peak, memory),
                   "lr": lr, **resumable_values(engine, args), **sampling, **balance}
        stop_on_nonfinite_weights(engine, step, metrics, log, close_loggers, out_dir, world, rank)

        # 7. weight sync
        t0 = time.time()
        sync_weights_to_vllm(engine, llm)
        timer["sync"] = metrics["time/sync"] = time.time() - t0

        if eval_rows and (step % args.eval_interval == 0 or step == args.steps):
            metrics.update(evaluate_held_out(llm, eval_rows, args, rank, world, step, out_dir))
        log(step, metrics)
        bar.set_postfix(acc=f"{metrics['reward/accuracy']:.3f}", pg=f"{metrics['loss/pg']:+.4f}",
                        len=f"{metrics['length/mean']:.0f}", refresh=False)
        bad_streak = bad_streak + 1 if metrics["train/skipped_updates"] else 0
        if step % args.save_interval == 0 or step == args.steps or bad_streak >= args.max_bad_steps:
            sizes = {**this_device, **{k: getattr(batching, k) for k in flags_with("size")}}
            save_step(engine, tokenizer, out_dir, step, order, bad_streak, args, sizes, rank, policy_weights(engine))
        stop_after_bad_steps(bad_streak, args.max_bad_steps, step)

    if rank == 0:
        final = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if final:
            print("[grpo] done: " + "  ".join(f"{k} {v:.3f}" for k, v in final.items()), flush=True)
        print(f"[grpo] run in {out_dir}/: metrics.jsonl, tb/ (TensorBoard), checkpoints/", flush=True)
    close_loggers()
    dist.barrier()

if __name__ == "__main__":
    main()
    exit_without_teardown()  # every file is closed and every rank is past the last barrier
