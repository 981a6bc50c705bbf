"""Ranks balanced by tokens (batching.balanced_deal, batching.balance_ranks), micro-batches cut by their own
sizing, no log-prob pass where nothing learns. tests/test_invariance.py holds the gradient of a batch dealt by
tokens to the 1-rank gradient on 2 ranks."""

import random

import pytest

from grpo_utils.batching import balanced_deal, micro_batches, micro_batching
from scripts.bench_rank_balance import contiguous_loads, grpo_lengths


def spread(loads: list[int]) -> float:
    return max(loads) * len(loads) / sum(loads)


def test_balanced_deal_gives_each_rank_as_many_groups_and_even_tokens():
    rng = random.Random(0)
    for world, per in ((2, 4), (8, 4), (8, 2), (4, 1)):
        tokens = [rng.randint(100, 20_000) for _ in range(world * per)]
        parts = balanced_deal(tokens, world)
        assert sorted(g for p in parts for g in p) == list(range(world * per))  # every group once
        assert all(len(p) == per for p in parts)  # as many groups (so responses) on every rank
        loads = [sum(tokens[g] for g in p) for p in parts]
        assert max(loads) - min(loads) <= max(tokens)  # within one group of each other
    assert balanced_deal([5, 1, 1, 5], 2) == [[0, 1], [2, 3]] or balanced_deal([5, 1, 1, 5], 2) == [[0, 2], [1, 3]]
    assert balanced_deal([9, 9, 1, 1], 2) == [[0, 2], [1, 3]]  # contiguous dealing would give 18 against 2


def test_balanced_deal_meets_the_goal_on_grpo_lengths():
    # the benchmark's distribution (scripts/bench_rank_balance.py): 32 groups of 16 a mini-batch on 8 ranks,
    # responses of mean ~3k tokens capped at 8k: as sampled the slowest rank holds far more than the mean
    rng = random.Random(1)
    worst_before, worst_after = 0.0, 0.0
    for _ in range(20):
        groups = [sum(grpo_lengths(rng, 16)) for _ in range(32)]
        worst_before = max(worst_before, spread(contiguous_loads(groups, 8)))
        worst_after = max(worst_after, spread([sum(groups[g] for g in p) for p in balanced_deal(groups, 8)]))
    assert worst_after <= 1.05 < worst_before


def test_micro_batches_cut_packed_parts_by_their_sum_and_padded_by_rows_times_the_longest():
    # a long tail: 30 short responses and 2 long ones, where packed and padded sizing cut differently
    lens = [20] * 30 + [2000] * 2
    packed, padded = micro_batches(lens, None, 4096), micro_batches(lens, None, 4096, packed=False)
    assert packed == [list(range(31)), [31]]  # 30 x 20 + 2000 = 2600 tokens, then the other long one
    assert padded == [list(range(30)), [30, 31]]  # 31 rows x 2000 would be 62000: the shorts alone, then the longs
    with pytest.raises(ValueError, match="cannot make the 5 micro-batches"):
        micro_batches([10] * 4, None, 100, count=5)


def test_no_log_prob_pass_runs_where_nothing_learns(monkeypatch):
    # every group scored alike and no KL term: the update is skipped, and so are the passes that would feed it
    from types import SimpleNamespace

    import torch

    import train_grpo
    from scripts.bench_step import synthetic_rollouts

    args = train_grpo.parse_args(["--model", "demo", "--minibatches", "2", "--group-size", "4"])
    calls = []
    monkeypatch.setattr(train_grpo, "fill_logprobs", lambda engine, rollouts, key, *a: calls.append(key))
    monkeypatch.setattr(train_grpo, "all_reduce", lambda values, op="sum": torch.as_tensor(values, dtype=torch.float64))
    monkeypatch.setattr(train_grpo, "update_minibatch", lambda *a: calls.append("update") or {"skipped": 0})
    engine = SimpleNamespace(train=lambda: None)
    rollouts = synthetic_rollouts(8, 4, 8, 100, seed=0)
    for adv, expected in ((torch.zeros(8, dtype=torch.float64), []),
                          (torch.tensor([1.0, -1.0] * 4, dtype=torch.float64), ["old_logp", "update", "update"])):
        calls.clear()
        train_grpo.update(engine, None, rollouts, adv, args, micro_batching(args), torch.device("cpu"), 1, {})
        assert calls == expected
