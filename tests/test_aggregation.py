"""aggregation_weights, group_advantages and the surrogate against hand-computed values."""

import argparse
import math

import pytest
import torch

from train_grpo import AGGS, aggregation_weights, group_advantages, policy_loss_per_token, sign_lengths

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


@pytest.mark.parametrize("agg", ["seq", "token", "balanced", "token-batch"])  # balanced-batch: only in expectation
def test_weights_sum_to_one_per_group_average(agg):
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(6 * 5, generator=g, dtype=torch.float64)
    L = torch.randint(1, 50, (30,), generator=g)
    w = aggregation_weights(adv, L, 5, agg)
    # each rule is a weighted mean of token terms: the weights of all tokens sum to 1
    assert (w * L).sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("agg", AGGS)  # every rule the trainer defines: a rule a fork adds is held here too
def test_every_rule_weighs_responses_alike_however_the_ranks_split_them(agg):
    """What loss_weights and the ranks assume of any rule: one finite w_i >= 0 per response, none for a masked
    one (L = 0); the same response weighed the same wherever its group sits in the mini-batch and wherever it
    sits in its group; and a rank's share, weighed with the mini-batch's statistics summed over ranks
    (sign_lengths) and averaged over the ranks (DeepSpeed), weighed as in the whole mini-batch."""
    g = torch.Generator().manual_seed(1)
    G, groups = 4, 6
    sign = torch.randint(-1, 2, (groups * G,), generator=g).double()  # each of A > 0, A < 0, A = 0
    adv = sign * torch.rand(groups * G, generator=g, dtype=torch.float64)
    L = torch.randint(1, 40, (groups * G,), generator=g)
    L[5] = 0  # masked by --mask-truncated
    batch = sign_lengths(adv, L)
    w = aggregation_weights(adv, L, G, agg, batch, max_len=40)
    assert w.shape == L.shape and torch.isfinite(w).all() and (w >= 0).all() and w[5] == 0
    assert (w[L > 0] > 0).any()
    for ranks in (2, 3):
        share = groups // ranks * G
        parts = [aggregation_weights(adv[k : k + share], L[k : k + share], G, agg, batch, max_len=40) / ranks
                 for k in range(0, len(L), share)]
        torch.testing.assert_close(torch.cat(parts), w, rtol=1e-12, atol=0)
    order = torch.cat([torch.randperm(G, generator=g) + G * k for k in torch.randperm(groups, generator=g)])
    torch.testing.assert_close(aggregation_weights(adv[order], L[order], G, agg, batch, max_len=40), w[order],
                               rtol=1e-12, atol=0)


def test_the_peer_rules_by_hand_with_a_mask_and_a_rank_split():
    # two groups of G = 4; response 3 is masked (L = 0): no terms, and no tokens in any denominator
    adv = F(1, 1, -1, -1, 1, -1, -1, -1)
    L = torch.tensor([2, 4, 6, 0, 3, 10, 2, 6])
    B, N = 8, 33  # responses (the masked one too) and tokens of the mini-batch
    # token-batch: 1 / N for every token of the mini-batch (verl's token-mean)
    want = torch.where(L > 0, 1 / N, 0.0).double()
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "token-batch"), want)
    # split over two ranks: each rank's sign_lengths, summed, and a mean over its own group; DeepSpeed's
    # average over the 2 ranks then halves each: the same weights as one rank holding both groups
    both = sign_lengths(adv[:4], L[:4]) + sign_lengths(adv[4:], L[4:])
    for half in (slice(0, 4), slice(4, 8)):
        torch.testing.assert_close(aggregation_weights(adv[half], L[half], 4, "token-batch", both) / 2, want[half])
    # Dr. GRPO: 1 / (B L_max); seq-sum: 1 / B
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "dr-grpo", max_len=12),
                               torch.where(L > 0, 1 / (B * 12), 0.0).double())
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "seq-sum"), torch.where(L > 0, 1 / B, 0.0).double())
    with pytest.raises(ValueError, match="max_len"):
        aggregation_weights(adv, L, 4, "dr-grpo")
    # token: the masked response adds nothing to its group's tokens (2+4+6 = 12); balanced: nor to N's size or
    # tokens (N = {6}); both then halved by the mean over the two groups
    token = F(1 / 12, 1 / 12, 1 / 12, 0, 1 / 21, 1 / 21, 1 / 21, 1 / 21) / 2
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "token"), token)
    # group 1: P = {2, 4}: (2/4) / 6; N = {6}: (1/4) / 6; group 2: P = {3}: (1/4) / 3; N = {10, 2, 6}: (3/4) / 18
    balanced = F(1 / 12, 1 / 12, 1 / 24, 0, 1 / 12, 1 / 24, 1 / 24, 1 / 24) / 2
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "balanced"), balanced)


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
    assert sign_lengths(F(1, -1), torch.tensor([0, 5])).tolist() == [[0, 0, 1], [5, 1, 1], [0, 0, 0]]
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
    for agg in ("token", "balanced", "balanced-batch", "token-batch"):
        torch.testing.assert_close(aggregation_weights(adv, L, 4, agg), seq)
    # the two sum rules differ from seq by a constant: L_max / L and 1 / L
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "dr-grpo", max_len=7), seq)
    torch.testing.assert_close(aggregation_weights(adv, L, 4, "seq-sum"), 7 * seq)


def test_group_advantages():
    r = F(1, 0, 0, 0, 1, 1, 1, 1)
    adv = group_advantages(r, 4)
    std = torch.tensor([1.0, 0, 0, 0]).std().item()
    torch.testing.assert_close(adv[:4], F(0.75, -0.25, -0.25, -0.25) / (std + 1e-6))
    assert adv[4:].abs().max() == 0  # zero-variance group carries no signal
    torch.testing.assert_close(group_advantages(r, 4, scale_by_std=False)[:4], F(0.75, -0.25, -0.25, -0.25))


def pg_loss_at_ratio_one(rewards, lengths, agg, group_size, loss="ppo"):
    """The aggregated surrogate sum_i w_i sum_t l_it with the policy equal to the old policy."""
    adv = group_advantages(rewards, group_size)
    w = aggregation_weights(adv, lengths, group_size, agg, max_len=int(lengths.max()))
    per_tok_adv = torch.repeat_interleave(adv, lengths)
    logp = torch.randn(int(lengths.sum()), dtype=torch.float64)
    eps = {"ppo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "cispo": (1.0, 4.0), "sapo": (None, None)}[loss]
    loss_t, _ = policy_loss_per_token(logp, logp, per_tok_adv, *eps, loss=loss, lengths=lengths)
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
    # every policy loss has the value -A on-policy, so the property is the rule's, whatever the loss
    for loss in ("gspo", "cispo", "sapo"):
        assert pg_loss_at_ratio_one(rewards, lengths, "balanced", 8, loss) == pytest.approx(0.0, abs=1e-12)
        assert pg_loss_at_ratio_one(rewards, lengths, "token", 8, loss) == pytest.approx(token, rel=1e-9)
    # the peer rules couple too: each is -sum_i w_i A_i L_i with w_i blind to the sign, so > 0 here
    for agg in ("token-batch", "dr-grpo", "seq-sum"):
        assert pg_loss_at_ratio_one(rewards, lengths, agg, 8) > 0.02


def test_clip_higher_surrogate():
    logp = torch.log(F(1.5, 0.5, 1.1, 0.7))
    old = torch.zeros(4, dtype=torch.float64)
    adv = F(1, -1, 1, -1)
    loss, st = policy_loss_per_token(logp, old, adv, 0.2, 0.28)
    # ratio 1.5 > 1.28 with A>0 -> clipped at 1.28; ratio 0.5 < 0.8 with A<0 -> clipped at 0.8
    torch.testing.assert_close(loss, F(-1.28, 0.8, -1.1, 0.8))
    assert st["clipped"].tolist() == [True, True, False, True]


def grad_of(loss_name, logp0, old, adv, eps=(None, None), lengths=None, tau=(1.0, 1.05)):
    logp = logp0.clone().requires_grad_(True)
    loss, st = policy_loss_per_token(logp, old, adv, *eps, loss=loss_name, lengths=lengths, tau=tau)
    loss.sum().backward()
    return loss.detach(), logp.grad, st


def test_every_policy_loss_is_the_policy_gradient_on_policy():
    logp = torch.log(F(0.3, 0.6, 0.1, 0.9))
    adv = F(1, 1, -0.5, -0.5)
    for name, eps in (("ppo", (0.2, 0.28)), ("gspo", (3e-4, 4e-4)), ("cispo", (1.0, 4.0)), ("sapo", (None, None))):
        value, grad, _ = grad_of(name, logp, logp, adv, eps, torch.tensor([2, 2]))
        torch.testing.assert_close(value, -adv)
        torch.testing.assert_close(grad, -adv)  # d(-A r)/d log pi at r = 1


def test_gspo_clips_whole_responses_by_their_geometric_mean_ratio():
    old = torch.zeros(3, dtype=torch.float64)
    logp = F(0.1, 0.3, -0.5)  # response 1: tokens 0-1, log-ratio mean 0.2; response 2: token 2, -0.5
    adv = F(1, 1, -1)
    s1 = math.exp(0.2)  # s2 = exp(-0.5) = 0.61
    value, grad, st = grad_of("gspo", logp, old, adv, (0.2, 0.3), torch.tensor([2, 1]))
    # s1 = 1.22 inside [0.8, 1.3]: each token's value s1 A, gradient s1 A (the sequence's s1 A / L_1 times L_1
    # tokens, once aggregated by seq); s2 = 0.61 < 0.8 with A < 0: clipped, value -0.8 A, no gradient
    torch.testing.assert_close(value, F(-s1, -s1, 0.8))
    torch.testing.assert_close(grad, F(-s1, -s1, 0.0))
    assert st["clipped"].tolist() == [False, False, True]
    # ppo on the same tokens decides per token: token 1 (r = e^0.3 = 1.35 > 1.3) is clipped alone
    _, grad_ppo, _ = grad_of("ppo", logp, old, adv, (0.2, 0.3))
    assert grad_ppo[0] != 0 and grad_ppo[1] == 0


def test_cispo_clips_the_weight_never_the_token():
    old = torch.zeros(4, dtype=torch.float64)
    logp = torch.log(F(0.5, 3.0, 7.0, 1.5))
    adv = F(1, 1, 1, -1)
    value, grad, st = grad_of("cispo", logp, old, adv, (1.0, 4.0))
    # weights min(r, 5): 0.5, 3, 5, 1.5; every token keeps a gradient -w A d log pi
    torch.testing.assert_close(value, F(-0.5, -3.0, -5.0, 1.5))
    torch.testing.assert_close(grad, F(-0.5, -3.0, -5.0, 1.5))
    assert st["clipped"].tolist() == [False, False, True, False]
    _, grad_ppo, _ = grad_of("ppo", logp, old, adv, (0.2, 0.28))
    assert grad_ppo[1] == 0 and grad_ppo[2] == 0  # ppo drops the tokens cispo keeps


def test_sapo_gate_by_hand():
    old = torch.zeros(2, dtype=torch.float64)
    logp = torch.log(F(1.5, 0.6))
    adv = F(2, -1)
    value, grad, st = grad_of("sapo", logp, old, adv, tau=(1.0, 1.05))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    g1, g2 = sig(0.5), sig(1.05 * -0.4)  # tau_pos (A > 0) and tau_neg (A < 0)
    torch.testing.assert_close(value, F(-2 * (4 * g1 + 1 - 2), 1 * (4 / 1.05 * g2 + 1 - 2 / 1.05)))
    # d/d log pi of -A f(r): -A 4 sigma (1 - sigma) r
    torch.testing.assert_close(grad, F(-2 * 4 * g1 * (1 - g1) * 1.5, 4 * g2 * (1 - g2) * 0.6))
    assert not st["clipped"].any()


def test_overlong_penalty_by_hand():
    from train_grpo import overlong_penalty

    # L_max 20, a buffer of 5: 0 up to 15 tokens, then down to -alpha at 20
    assert [overlong_penalty(n, 20, 5, 1.0) for n in (10, 15, 16, 18, 20)] == [0, 0, -0.2, -0.6, -1.0]
    assert overlong_penalty(20, 20, 5, 0.5) == -0.5
    assert overlong_penalty(20, 20, 0, 1.0) == 0  # no buffer: off


def test_dealing_kept_groups_on_one_rank(monkeypatch):
    import train_grpo

    monkeypatch.setattr(train_grpo, "all_gather_objects", lambda obj: [obj])
    held = {gid: [{"gid": gid, "row": {}, "text": ""}] for gid in (1, 4, 5, 9, 12)}
    kept = [1, 4, 5, 9, 12]  # sampling order
    # the first target kept, rounded down to what divides into ranks x mini-batches
    assert [r["gid"] for r in train_grpo.deal_groups(held, kept, 4, 1, 0, 1)] == [1, 4, 5, 9]
    assert [r["gid"] for r in train_grpo.deal_groups(held, kept[:3], 4, 2, 0, 1)] == [1, 4]
    assert train_grpo.deal_groups(held, kept[:1], 4, 2, 0, 1) == []


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
    from scripts.ablation import rule_args
    from scripts.length_drift import hazard_push, simulated_push

    def rule(agg: str, group_size: int) -> argparse.Namespace:  # the lab's run of the rule, in groups of G
        return argparse.Namespace(**{**vars(rule_args("lab", agg)), "group_size": group_size})

    # one group, A = +-1/sqrt(2); hazard of lengths {1, 2}: h_1 = 1/2, h_2 = 1, so H(1) = 0.5, H(2) = 1.5;
    # seq: w = 1/(G L) = (1/2, 1/4): push = 1/2 a (1 - 0.5) + 1/4 (-a) (1 - 1.5)
    a = 2**-0.5 / (1 + 1e-6 * 2**0.5)
    push = hazard_push(F(1, 0), torch.tensor([1, 2]), rule("seq", 2))
    assert push == pytest.approx(0.25 * a + 0.125 * a)
    # lengths independent of rewards: no push from seq or token; balanced pushes towards stopping when
    # successes are the minority and away from it when they are the majority; balanced-batch ~ not
    L = torch.arange(6, 36)
    rules = ("seq", "token", "balanced", "balanced-batch")
    low = {agg: simulated_push(L, 0.22, rule(agg, 8), groups=16_000) for agg in rules}
    high = simulated_push(L, 0.78, rule("balanced", 8), groups=16_000)
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
            args = SimpleNamespace(mask_truncated=masked, agg="seq", group_size=G, minibatches=minibatches,
                                   max_response_len=10)
            w = loss_weights(adv, rollouts, args)
            expected = torch.tensor([1 / (G * n) for n in lengths], dtype=torch.float64) / (2 / minibatches)
            if masked:
                expected[-1] = 0.0  # a truncated response has no loss under --mask-truncated
            torch.testing.assert_close(w, expected)


def test_token_batch_normalises_each_mini_batch_by_its_own_tokens(monkeypatch):
    from types import SimpleNamespace

    import train_grpo

    monkeypatch.setattr(train_grpo, "all_reduce", lambda values, op="sum": torch.as_tensor(values))  # one rank
    adv = group_advantages(torch.tensor([1.0, 0, 0, 1, 0, 1, 0, 0], dtype=torch.float64), 4)
    rollouts = [{"length": n, "truncated": False} for n in [3, 5, 7, 2, 4, 6, 8, 10]]
    args = SimpleNamespace(mask_truncated=False, agg="token-batch", group_size=4, minibatches=2, max_response_len=10)
    w = train_grpo.loss_weights(adv, rollouts, args)
    torch.testing.assert_close(w, torch.tensor([1 / 17] * 4 + [1 / 28] * 4, dtype=torch.float64))
