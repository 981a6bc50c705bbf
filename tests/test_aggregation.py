"""aggregation_weights, group_advantages and the surrogate against hand-computed values."""

import pytest
import torch

from train_grpo import aggregation_weights, group_advantages, policy_loss_per_token, sign_lengths

F = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731


def test_hand_computed_weights_one_group():
    adv, L = F(1, 1, -1, -1), torch.tensor([2, 4, 6, 8])
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "seq"), F(1 / 8, 1 / 16, 1 / 24, 1 / 32))
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "token"), F(1 / 20, 1 / 20, 1 / 20, 1 / 20))
    # P = {0,1}: |P|/G / (2+4) = 1/12;  N = {2,3}: |N|/G / (6+8) = 1/28
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "balanced"), F(1 / 12, 1 / 12, 1 / 28, 1 / 28))


def test_balanced_with_zero_advantage_subset_and_group_mean():
    # group 1: P={0}, Z={1,3}, N={2}; group 2: all zero advantage -> one subset Z
    adv = F(1, 0, -1, 0, 0, 0, 0, 0)
    L = torch.tensor([2, 4, 6, 8, 1, 1, 1, 1])
    w = aggregation_weights(adv, L, 4, "balanced")
    # 1/(4*2), Z: 2/(4*(4+8)), N: 1/(4*6); group 2: 4/(4*4) each; then / 2 groups
    torch.testing.assert_close(w, F(1 / 8, 1 / 24, 1 / 24, 1 / 24, 1 / 4, 1 / 4, 1 / 4, 1 / 4) / 2)


@pytest.mark.parametrize("agg", ["seq", "token", "balanced"])  # balanced-batch: only in expectation
def test_weights_sum_to_one_per_group_average(agg):
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(6 * 5, generator=g, dtype=torch.float64)
    L = torch.randint(1, 50, (30,), generator=g)
    w = aggregation_weights(adv, L, 5, agg)
    # each rule is a weighted mean of token terms: the weights of all tokens sum to 1
    assert (w * L).sum().item() == pytest.approx(1.0)


def test_balanced_batch_normalises_each_sign_by_its_batch_mean_length():
    # group 1: P = {0, 1}, N = {2, 3}; group 2: P = {4}, N = {5, 6, 7}
    adv = F(1, 1, -1, -1, 1, -1, -1, -1)
    L = torch.tensor([2, 4, 6, 8, 3, 10, 2, 6])
    # batch means: P (2 + 4 + 3) / 3 = 3, N (6 + 8 + 10 + 2 + 6) / 5 = 6.4; w = 1 / (G Lbar) / 2 groups
    want = torch.where(adv > 0, 1 / (4 * 3.0), 1 / (4 * 6.4)).double() / 2
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "balanced-batch"), want)
    # the batch means over ranks: each rank's sums, added, give the same weights as the whole batch
    halves = sign_lengths(adv[:4], L[:4]) + sign_lengths(adv[4:], L[4:])
    torch.testing.assert_close(aggregation_weights(adv[:4], L[:4], 4, "balanced-batch", halves) / 2, want[:4])
    # masked (L = 0) responses do not count in the means, and carry no weight
    assert sign_lengths(F(1, -1), torch.tensor([0, 5])).tolist() == [[0, 0], [5, 1], [0, 0]]
    # a group whose subsets have the batch's mean lengths weighs them exactly as balanced does
    same = torch.tensor([3, 3, 6, 6, 3, 6, 6, 6])
    torch.testing.assert_close(aggregation_weights(adv, same, 4, "balanced-batch"),
                               aggregation_weights(adv, same, 4, "balanced"))


def test_balanced_batch_keeps_the_coupling_removed_in_expectation():
    # Figure 2's property holds for balanced-batch only in expectation: per batch the on-policy loss
    # is not 0, but over many batches with sign-coupled lengths it is ~0, unlike token-agg's
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(200):
        rewards = (torch.rand(32 * 8, generator=g) < 0.4).double()
        lengths = torch.where(rewards > 0, torch.randint(50, 150, (256,), generator=g),
                              torch.randint(200, 400, (256,), generator=g))
        losses.append(pg_loss_at_ratio_one(rewards, lengths, "balanced-batch", 8))
    assert max(abs(x) for x in losses) > 1e-3  # not exactly zero batch by batch
    assert abs(sum(losses) / len(losses)) < 3e-3  # token-agg's loss on such batches: > 0.1 (figure 2 test)


def test_all_rules_coincide_when_lengths_are_equal():
    adv = F(1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 1.0, -1.0)
    L = torch.full((8,), 7)
    seq = aggregation_weights(adv, L, 4, "seq")
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "token"), seq)
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "balanced"), seq)


def test_group_advantages():
    r = F(1, 0, 0, 0, 1, 1, 1, 1)
    adv = group_advantages(r, 4)
    std = torch.tensor([1.0, 0, 0, 0]).std().item()
    torch.testing.assert_close(adv[:4], F(0.75, -0.25, -0.25, -0.25) / (std + 1e-6))
    assert adv[4:].abs().max() == 0  # zero-variance group carries no signal
    torch.testing.assert_close(group_advantages(r, 4, scale_by_std=False)[:4], F(0.75, -0.25, -0.25, -0.25))


def pg_loss_at_ratio_one(rewards, lengths, agg, group_size):
    """The aggregated surrogate sum_i w_i sum_t l_it with the policy equal to the old policy."""
    adv = group_advantages(rewards, group_size)
    w = aggregation_weights(adv, lengths, group_size, agg)
    per_tok_adv = torch.repeat_interleave(adv, lengths)
    logp = torch.randn(int(lengths.sum()), dtype=torch.float64)
    loss_t, _ = policy_loss_per_token(logp, logp, per_tok_adv, 0.2, 0.28)
    return (torch.repeat_interleave(w, lengths) * loss_t).sum().item()


def test_sign_length_coupling_figure_2():
    # binary rewards, failed responses longer than successful ones
    g = torch.Generator().manual_seed(1)
    rewards = (torch.rand(64 * 8, generator=g) < 0.4).double()
    lengths = torch.where(rewards > 0, torch.randint(50, 150, (512,), generator=g),
                          torch.randint(200, 400, (512,), generator=g))
    assert pg_loss_at_ratio_one(rewards, lengths, "seq", 8) == pytest.approx(0.0, abs=1e-12)
    assert pg_loss_at_ratio_one(rewards, lengths, "balanced", 8) == pytest.approx(0.0, abs=1e-12)
    token = pg_loss_at_ratio_one(rewards, lengths, "token", 8)
    assert token > 0.1  # negative-advantage terms dominate: the loss sits well above zero


def test_clip_higher_surrogate():
    logp = torch.log(F(1.5, 0.5, 1.1, 0.7))
    old = torch.zeros(4, dtype=torch.float64)
    adv = F(1, -1, 1, -1)
    loss, st = policy_loss_per_token(logp, old, adv, 0.2, 0.28)
    # ratio 1.5 > 1.28 with A>0 -> clipped at 1.28; ratio 0.5 < 0.8 with A<0 -> clipped at 0.8
    torch.testing.assert_close(loss, F(-1.28, 0.8, -1.1, 0.8))
    assert st["clipped"].tolist() == [True, True, False, True]


def test_unknown_rule_is_rejected():
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregation_weights(F(1, -1), torch.tensor([1, 2]), 2, "median")


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_logprobs_equal_the_full_softmax(chunk):
    from train_grpo import chunked_logprobs

    g = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(23, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (23,), generator=g)
    got = chunked_logprobs(head, h, t, 0.7, chunk)
    (got * torch.arange(23)).sum().backward()
    grads = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None
    ref = torch.log_softmax(head(h) / 0.7, -1).gather(-1, t[:, None]).squeeze(-1)
    (ref * torch.arange(23)).sum().backward()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(grads[0], h.grad)
    torch.testing.assert_close(grads[1], head.weight.grad)
    assert "forward" not in head.__dict__ and head(h).shape == (23, 50)  # the module is itself again
    assert chunked_logprobs(head, h[:0], t[:0], 1.0, chunk).shape == (0,)


def test_length_drift_push_on_the_stopping_decision():
    from length_drift import hazard_push, simulated_push

    # one group, A = +-1/sqrt(2); hazard of lengths {1, 2}: h_1 = 1/2, h_2 = 1, so H(1) = 0.5, H(2) = 1.5;
    # seq: w = 1/(G L) = (1/2, 1/4): push = 1/2 a (1 - 0.5) + 1/4 (-a) (1 - 1.5)
    a = 2**-0.5 / (1 + 1e-6 * 2**0.5)
    push = hazard_push(F(1, 0), torch.tensor([1, 2]), 2, "seq")
    assert push == pytest.approx(0.25 * a + 0.125 * a)
    # lengths independent of rewards: no push from seq or token; balanced pushes towards stopping when
    # successes are the minority and away from it when they are the majority; balanced-batch ~ not
    L = torch.arange(6, 36)
    rules = ("seq", "token", "balanced", "balanced-batch")
    low = {agg: simulated_push(L, 0.22, 8, agg, groups=16_000) for agg in rules}
    high = simulated_push(L, 0.78, 8, "balanced", groups=16_000)
    assert low["balanced"] > 10 * max(abs(low["seq"]), abs(low["token"]), abs(low["balanced-batch"]))
    assert high < 0 and abs(high + low["balanced"]) < 0.3 * low["balanced"]


def test_rollout_correction_weights_by_their_formulas():
    from train_grpo import rollout_correction

    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0], dtype=torch.float64)
    vllm = torch.tensor([-1.5, -1.0, -0.5, -3.0, -0.5], dtype=torch.float64)  # log rho: .5, -1, 0 | 0, -.5
    lengths = torch.tensor([3, 2])
    rho = torch.exp(old - vllm)
    torch.testing.assert_close(rollout_correction(old, vllm, lengths, "token", 2.0), rho.clamp(max=2.0))
    assert rollout_correction(old, vllm, lengths, "token", 1.5)[0] == 1.5  # e^.5 = 1.65 truncated at C
    # sequence: geometric means e^(-1/6) = 0.85 and e^(-1/4) = 0.78; C = 1.25 keeps the first only
    assert rollout_correction(old, vllm, lengths, "sequence", 1.25).tolist() == [1, 1, 1, 0, 0]
    assert rollout_correction(old, vllm, lengths, "sequence", 1.3).tolist() == [1] * 5
    assert rollout_correction(old, vllm, lengths, "none", 1.3).tolist() == [1] * 5


def test_the_correction_scales_each_tokens_gradient_and_nothing_else():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(12, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(12, generator=g, dtype=torch.float64)
    c = torch.rand(12, generator=g, dtype=torch.float64) * 2
    grads = []
    for correction in (None, c):
        logp = (old + 0.3 * torch.randn(12, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
        logp.requires_grad_(True)
        loss, _ = policy_loss_per_token(logp, old, adv, 0.2, 0.28, correction=correction)
        loss.sum().backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[1], c * grads[0])
    assert not torch.allclose(grads[1], grads[0])


def test_loss_weights_mask_truncation_and_average_per_mini_batch():
    from types import SimpleNamespace

    from train_grpo import loss_weights

    G = 4
    adv = group_advantages(torch.tensor([1.0, 0, 0, 1, 0, 1, 0, 0], dtype=torch.float64), G)
    lengths = [3, 5, 7, 2, 4, 6, 8, 10]
    rollouts = [{"length": n, "truncated": n == 10} for n in lengths]
    for masked in (False, True):
        for minibatches in (1, 2):
            args = SimpleNamespace(mask_truncated=masked, agg="seq", group_size=G, minibatches=minibatches)
            w = loss_weights(adv, rollouts, args)
            expected = torch.tensor([1 / (G * n) for n in lengths], dtype=torch.float64) / (2 / minibatches)
            if masked:
                expected[-1] = 0.0  # a truncated response has no loss under --mask-truncated
            torch.testing.assert_close(w, expected)
