"""The gradient of one GRPO batch does not depend on the number of ranks or the micro-batch size."""

import pytest
import torch
from conftest import deepspeed_run

from train_grpo import AGGS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deltas(demo_dir, tmp_path_factory):
    """Parameter change after one SGD(lr=1) update, i.e. minus the gradient, for each rule."""
    out = {}
    for nproc, micro in ((1, 16), (2, 1)):
        path = tmp_path_factory.mktemp("probe") / f"delta_{nproc}_{micro}.pt"
        res = deepspeed_run(nproc, "tests/grad_probe.py", str(demo_dir / "model"), str(path), str(micro))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        out[nproc] = torch.load(path)
    return out


# every rule the trainer defines (a rule a fork adds is held here with no test edited), under ppo; the policy
# losses under balanced; dynamic sampling: 2 rounds fill the step, 1 round leaves it half full (grad_probe.CASES);
# and every rule again with LoRA adapters, the base frozen (grad_probe.LORA_CASES)
CASES = [*AGGS, "gspo", "cispo", "sapo", "dynamic-2", "dynamic-1"]
LORA = [f"{agg}-lora" for agg in AGGS]


OFFLOAD = ["seq", "token-batch", "dynamic-2", "dynamic-1"]  # grad_probe.OFFLOAD_CASES: the accumulation boundary


def assert_same_gradient(one: dict, two: dict) -> None:
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5, abs=1e-9)
    flat1 = torch.cat([one["delta"][k].flatten() for k in sorted(one["delta"])])
    flat2 = torch.cat([two["delta"][k].flatten() for k in sorted(two["delta"])])
    assert flat1.abs().max() > 1e-6  # the batch produced a real gradient
    # fp32 sums in another order: an ulp or two of the largest entry, and the deltas are differences
    # of fp32 weights, so also an ulp or two of a norm weight near 1 (2 x 1.19e-7); a wrong scaling
    # of the gradient (a factor of the world size or the accumulation steps) is 1e4 times larger
    atol = 1e-5 * float(flat1.abs().max()) + 2 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(flat2, flat1, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("case", CASES + LORA + [f"{case}-offload" for case in OFFLOAD])
def test_gradient_same_for_1_rank_full_batch_and_2_ranks_micro_1(case, deltas):
    one, two = deltas[1][case], deltas[2][case]
    # the loss is built from the engine's output, so DeepSpeed's backward prologue ran every time
    assert one["prologues"] == one["micro_steps"] and two["prologues"] == two["micro_steps"]
    assert two["micro_steps"] == (4 if case.startswith("dynamic-1") else 8)
    assert one["responses"] == two["responses"] == (8 if case.startswith("dynamic-1") else 16)
    assert_same_gradient(one, two)


@pytest.mark.parametrize("case", ["balanced", "dynamic-1"])  # grad_probe.TOKEN_CASES
def test_token_budget_micro_batches_give_the_same_gradient(case, deltas):
    # micro-batches cut by --micro-batch-tokens on 1 and 2 ranks against the 1-rank full batch
    for world in (1, 2):
        run = deltas[world][f"{case}-tokens"]
        assert run["prologues"] == run["micro_steps"] > (1 if world == 2 else 2)
        assert_same_gradient(deltas[1][case], run)
    # the 2 ranks cut their shares into different numbers of micro-batches, evened out (ZeRO-3 gathers in each)
    assert deltas[2]["balanced-tokens"]["evened"] or deltas[2]["dynamic-1-tokens"]["evened"]


@pytest.mark.parametrize("case", ["balanced", "token-batch"])  # grad_probe.DEALT_CASES
def test_groups_dealt_by_tokens_give_the_same_gradient(case, deltas):
    # each rank's groups dealt anew by their tokens (balance_ranks): on 2 ranks groups move and the ranks' tokens
    # even out, and the gradient is the contiguous dealing's and the 1-rank full batch's
    two, sampled = deltas[2][f"{case}-dealt"], deltas[2][f"{case}-sampled"]
    assert two["moved"] > 0 and deltas[1][f"{case}-dealt"]["moved"] == sampled["moved"] == 0
    assert max(two["tokens"]) - min(two["tokens"]) < max(sampled["tokens"]) - min(sampled["tokens"])
    assert_same_gradient(deltas[1][f"{case}-sampled"], two)  # the 1-rank full batch
    assert_same_gradient(sampled, two)  # the same 2 ranks, each training what it sampled


def test_the_cases_give_different_gradients(deltas):
    # guards against a probe that ignores the rule, the loss or the sampling: each case's gradient differs
    # from the others' (the two sum rules only by a constant: dr-grpo's 1 / L_max)
    flat = {case: torch.cat([d["delta"][k].flatten() for k in sorted(d["delta"])])
            for case, d in deltas[1].items() if not case.endswith("offload")}
    eps = torch.finfo(torch.float32).eps  # the deltas' own rounding (see above), times 17
    torch.testing.assert_close(flat["dr-grpo"] * 17, flat["seq-sum"], rtol=1e-4,
                               atol=1e-5 * float(flat["seq-sum"].abs().max()) + 17 * 2 * eps)
    distinct = [c for c in CASES if c != "dr-grpo"]
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            assert not torch.allclose(flat[a], flat[b], rtol=1e-3, atol=1e-7), (a, b)
    # the off-policy batches clip: ppo and gspo drop some tokens' gradients, cispo truncates some weights
    assert all(deltas[1][c]["clipped"] > 0 for c in ("balanced", "gspo", "cispo"))


@pytest.mark.parametrize("case", CASES + ["balanced-lora"])  # grad_probe.LORA_PADDED
def test_packed_rows_give_the_padded_logprobs_and_gradient(case, deltas):
    # every rule, policy loss and dynamic-sampling case, on 1 rank (one micro-batch of 16) and 2 (micro-batches
    # of one response): packed rows (the default) against right-padded ones (--padded), on the same model code
    for world in (1, 2):
        packed, padded = deltas[world][case], deltas[world][f"{case}-padded"]
        assert padded["padded"] and not packed["padded"]
        # per-token log-probs of the same responses: fp32 attention summed in another order (one sequence alone
        # against a masked row) moves a log-prob of magnitude ~10 by a few ulps (eps x 10 = 1.2e-6); attention
        # that crossed into a neighbouring sequence moves it by 1e-2 and more (tests/test_packing.py)
        assert packed["logp"].shape == padded["logp"].shape and len(packed["logp"]) > 40  # rank 0's responses
        atol = 8 * torch.finfo(torch.float32).eps * float(padded["logp"].abs().max())
        torch.testing.assert_close(packed["logp"], padded["logp"], rtol=0, atol=atol)
        assert_same_gradient(padded, packed)


def test_lora_moves_the_adapters_alone(deltas):
    # --lora-rank: the base's weights (embedding, norms, every linear layer's W) do not move; every adapter does
    for case in LORA:
        delta = deltas[1][case]["delta"]
        adapters = [k for k in delta if ".lora_A." in k or ".lora_B." in k]
        assert len(adapters) == 2 * 7 * 2  # A and B of 7 linear layers in each of the demo's 2 layers
        assert all(delta[k].abs().max() > 0 for k in adapters)
        assert all(torch.count_nonzero(v) == 0 for k, v in delta.items() if k not in adapters), case
