"""The update's micro-batches: packed rows (each sequence its own positions from 0, attention confined to it by
a variable-length kernel: no pad token is computed), the attention kernels, the cut of a pass into micro-batches
by a token budget, and the groups dealt to ranks by their tokens."""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
from collections import Counter

import torch

from grpo_utils.distributed import all_gather_objects
from grpo_utils.flags import flags_with

# packed_attention's calls by the path each took, in attention_kind's names ("sdpa": each sequence through
# scaled_dot_product_attention's default kernels, where the flash kernel does not apply): tests/update_check.py
# reports which attention ran
ATTENTION_CALLS: Counter[str] = Counter()


def pack_batch(seqs: list[list[int]], prompt_lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """[1, N] input_ids and response_mask for the sequences prompt+response packed into one row, and the model's
    keyword arguments for it: per-sequence position_ids and the cumulative lengths packed_attention reads."""
    assert min(prompt_lens) >= 1  # a sequence's first token is a prompt token: nothing predicts across a boundary
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s])
    resp = torch.cat([torch.arange(n) >= p for n, p in zip(lens, prompt_lens)])
    positions = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    inputs = dict(position_ids=positions[None].to(device), cu_seq_lens_q=cu.to(device), cu_seq_lens_k=cu.to(device),
                  max_length_q=max(lens), max_length_k=max(lens))
    return ids[None].to(device), resp[None].to(device), inputs


def pad_batch(seqs: list[list[int]], prompt_lens: list[int], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """--padded: right-padded input_ids, response_mask and the model's attention_mask, one row a sequence."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    resp = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        resp[i, p : len(s)] = True
    return ids.to(device), resp.to(device), {"attention_mask": attn.to(device)}


def model_inputs(mb: list[dict], batching, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    seqs, prompts = [r["tokens"] for r in mb], [r["prompt_len"] for r in mb]
    if batching.padded:
        return pad_batch(seqs, prompts, batching.pad_id, device)
    return pack_batch(seqs, prompts, device)


def micro_batching(args, tokenizer=None) -> argparse.Namespace:
    """How the update builds and cuts its micro-batches: packed rows, or --padded ones padded with the tokenizer's
    pad token (else its end of sequence), and the "size" flags as parsed. What a run learns over them, the sizes a
    checkpoint recorded (apply_recorded_sizes) or the budget measured at the first update (memory_to_update), is
    set here, never in the arguments."""
    pad_id = 0 if tokenizer is None else tokenizer.eos_token_id if tokenizer.pad_token_id is None \
        else tokenizer.pad_token_id
    return argparse.Namespace(padded=args.padded, pad_id=pad_id, **{k: getattr(args, k) for k in flags_with("size")})


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention within each sequence of a packed row ([1, heads, N, head_dim]; cu_seq_lens_q: the
    sequences' cumulative lengths), memory linear in N. CUDA: torch's variable-length flash kernel (GQA
    native); --deterministic, fp32 or the CPU: each sequence through scaled_dot_product_attention, the math
    kernel under --deterministic (its backward has no atomics). Rows without cu_seq_lens_q (--padded) go
    through transformers' SDPA with their mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        ATTENTION_CALLS["sdpa-masked"] += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("packed rows attend to whole sequences, not a sliding window: train this model with --padded")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, head_dim]
    deterministic = torch.are_deterministic_algorithms_enabled()
    if flash_kernel_applies(q):
        ATTENTION_CALLS["flash"] += 1
        from torch.nn.attention.varlen import varlen_attn

        # contiguous [N, heads, head_dim], as the kernel's examples lay them out: Qwen2's projections and rotary
        # outputs already are (a no-op there), a layout that is not gets a copy
        m = kwargs["max_length_q"]
        q, k, v = (x.contiguous() for x in (q, k, v))
        out = varlen_attn(q, k, v, cu, cu, m, m, scale=scaling, window_size=(-1, 0), enable_gqa=True)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ATTENTION_CALLS["math" if deterministic else "sdpa"] += 1
        bounds = cu.tolist()
        with sdpa_kernel([SDPBackend.MATH]) if deterministic else contextlib.nullcontext():
            out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
                scale=scaling, enable_gqa=True).transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])])
    return out[None], None  # [1, N, heads, head_dim], as transformers' attention functions return


def flash_kernel_applies(q: torch.Tensor) -> bool:
    """torch's variable-length flash kernel runs half precision on CUDA; not under --deterministic (atomics), nor
    with a torch older than the pinned one whose kernel lacks causal windows or GQA (one sequence at a time then)."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    return q.is_cuda and half and not torch.are_deterministic_algorithms_enabled() and varlen_kernel_here()


@functools.cache
def varlen_kernel_here() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return {"window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters)


def attention_implementation(args) -> str:
    """The policy's attention: "packed" (packed_attention, registered here), or eager under --padded
    --deterministic (its backward is plain matmuls, where SDPA's flash and memory-efficient kernels use atomics)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("packed", packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("packed", sdpa_mask)  # --padded rows: SDPA's mask from theirs
    return "eager" if args.padded and args.deterministic else "packed"


def attention_kind(args, cuda: bool) -> str:
    """The attention kernel the update runs (packed_attention, attention_implementation), as memory_model names
    it: flash (linear in the tokens), math (each sequence's scores materialised), sdpa-masked (--padded: SDPA
    with a padding mask) or eager (--padded --deterministic)."""
    if args.padded:
        return "eager" if args.deterministic else "sdpa-masked"
    return "math" if args.deterministic or not cuda else "flash"


def micro_batches(seq_lens: list[int], max_rows: int | None, max_tokens: int = 0, count: int = 0,
                  packed: bool = True) -> list[list[int]]:
    """The micro-batches of one pass, as index lists: responses sorted by length (prompt + response), cut into
    runs of at most `max_rows`; with a token budget (max_tokens > 0) also of at most `max_tokens` tokens (packed:
    their sum; padded: rows x the longest), as verl's dynamic batch size. Then the one with most tokens is halved
    until there are `count`: ZeRO-3 gathers the weights in every forward, so every rank must make as many. The
    gradient is a sum over responses: any partition gives the same one."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    rows = max_rows or len(order)
    size = (lambda b: sum(seq_lens[i] for i in b)) if packed else (lambda b: len(b) * seq_lens[b[-1]])
    parts = []
    for i in order:  # ascending: a padded part's last response is its longest
        if not parts or len(parts[-1]) == rows or (max_tokens and size(parts[-1] + [i]) > max_tokens):
            parts.append([])
        parts[-1].append(i)
    if count > len(seq_lens):  # each micro-batch holds a response at least: ranks hold as many (balance_ranks)
        raise ValueError(f"{len(seq_lens)} responses cannot make the {count} micro-batches another rank makes")
    while len(parts) < count:
        k = max((j for j in range(len(parts)) if len(parts[j]) > 1), key=lambda j: size(parts[j]))
        b = parts[k]
        parts[k : k + 1] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return parts


def balanced_deal(tokens: list[int], world: int) -> list[list[int]]:
    """Groups (indices of `tokens`, a group's tokens each) dealt to `world` ranks, as many to each: the largest
    first, each to the rank with the fewest tokens that still has room (LPT); then, while one lowers it, the
    heaviest rank swaps a group with another rank's (the swap leaving the lower maximum of the two)."""
    per, load, parts = len(tokens) // world, [0] * world, [[] for _ in range(world)]
    for g in sorted(range(len(tokens)), key=lambda g: (-tokens[g], g)):
        r = min((r for r in range(world) if len(parts[r]) < per), key=lambda r: (load[r], r))
        parts[r].append(g)
        load[r] += tokens[g]
    for _ in range(len(tokens) * world):
        hi = max(range(world), key=lambda r: (load[r], -r))
        swaps = [(max(load[hi] - d, load[r] + d), r, a, b) for r in range(world) for a in parts[hi] for b in parts[r]
                 if 0 < (d := tokens[a] - tokens[b]) < load[hi] - load[r]]
        if not swaps:
            break
        _, r, a, b = min(swaps)
        parts[hi][parts[hi].index(a)], parts[r][parts[r].index(b)] = b, a
        load[hi], load[r] = load[hi] - tokens[a] + tokens[b], load[r] + tokens[a] - tokens[b]
    return [sorted(p) for p in parts]


def balance_ranks(rollouts: list[dict], group_size: int, minibatches: int, rank: int, world: int
                  ) -> tuple[list[dict], dict[str, float]]:
    """This rank's groups once each mini-batch's groups (every rank's k-th share) are dealt anew by their tokens
    (balanced_deal), and the max / mean of per-rank tokens of the slowest mini-batch before and after: the slowest
    rank sets every step's pace. A mini-batch keeps its groups and every normaliser is summed over ranks
    (train_grpo.loss_weights), so the gradient is the same. Only the groups that move are sent."""
    n = len(rollouts) // group_size
    if world == 1 or n == 0 or n % minibatches:
        return rollouts, {}
    group = lambda j: rollouts[j * group_size : (j + 1) * group_size]  # noqa: E731
    every = all_gather_objects([sum(len(r["tokens"]) for r in group(j)) for j in range(n)])
    per, owner, mine, before, after = n // minibatches, {}, [], [], []
    for k in range(minibatches):
        ids = [(r, j) for r in range(world) for j in range(k * per, (k + 1) * per)]
        parts = balanced_deal([every[r][j] for r, j in ids], world)
        owner.update({ids[i]: r for r, part in enumerate(parts) for i in part})
        mine += [ids[i] for i in parts[rank]]
        spread = lambda loads: max(loads) * world / max(1, sum(loads))  # noqa: E731
        before.append(spread([sum(every[r][k * per : (k + 1) * per]) for r in range(world)]))
        after.append(spread([sum(every[ids[i][0]][ids[i][1]] for i in part) for part in parts]))
    leaving = {j: [{key: v for key, v in r.items() if key not in ("row", "text")} for r in group(j)]
               for j in range(n) if owner[(rank, j)] != rank}
    arrived = all_gather_objects(leaving)
    dealt = [r for src, j in mine for r in (group(j) if src == rank else arrived[src][j])]
    return dealt, {"perf/rank_tokens_max_mean": max(after), "perf/rank_tokens_max_mean_as_sampled": max(before)}
