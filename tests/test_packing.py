"""Packed micro-batches on the real model code (transformers' Qwen2, the demo policy), without DeepSpeed: one row
of sequences back to back gives each sequence the log-probs and gradient it has alone in a padded row.
tests/test_invariance.py holds the same through the trainer's ZeRO-3 update, for every rule and loss, 1 and 2 ranks."""

import argparse
import math

import pytest
import torch

import train_grpo
from grpo_utils import batching, memory

LENGTHS = (7, 19, 3, 12, 1)  # response tokens; each after a 5-token prompt


@pytest.fixture(scope="module")
def policy(demo_dir):
    from transformers import AutoModelForCausalLM

    args = argparse.Namespace(padded=False, deterministic=False)
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model", dtype=torch.float32,
                                                 attn_implementation=batching.attention_implementation(args))
    model.module = model  # token_logprobs reads the lm_head of a DeepSpeed engine's .module
    return model


def batch(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"tokens": torch.randint(1, vocab, (5 + n,), generator=g).tolist(), "prompt_len": 5, "length": n}
            for n in LENGTHS]


def logprobs_and_grad(model, mb: list[dict], padded: bool, **packed_inputs):
    args = argparse.Namespace(padded=padded, pad_id=0)
    model.zero_grad()
    ids, resp, inputs = batching.model_inputs(mb, args, torch.device("cpu"))
    inputs.update(packed_inputs)
    logp = train_grpo.token_logprobs(model, ids, resp, inputs, 1.0, 7)
    (logp * torch.linspace(-1, 1, len(logp))).sum().backward()  # any per-token weights: a loss's gradient
    return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def test_pack_batch_restarts_positions_and_bounds_each_sequence():
    ids, resp, inputs = batching.pack_batch([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [2, 1, 3], torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and inputs["max_length_q"] == 4
    assert inputs["cu_seq_lens_q"].dtype == torch.int32  # what the flash kernel takes
    # the response tokens; a sequence's first token is a prompt's, so none is predicted across a boundary
    assert resp.tolist() == [[False, False, True, False, True, False, False, False, True]]
    with pytest.raises(AssertionError):
        batching.pack_batch([[1, 2]], [0], torch.device("cpu"))


def test_packed_row_equals_padded_rows(policy):
    mb = batch(policy.config.vocab_size)
    packed_lp, packed_grad = logprobs_and_grad(policy, mb, padded=False)
    padded_lp, padded_grad = logprobs_and_grad(policy, mb, padded=True)
    assert len(packed_lp) == sum(LENGTHS)
    # fp32 attention summed in another order: a few ulps of the largest log-prob (justified in test_invariance)
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(packed_lp, padded_lp, rtol=0, atol=8 * eps * float(padded_lp.abs().max()))
    torch.testing.assert_close(packed_grad, padded_grad, rtol=1e-4, atol=1e-5 * float(padded_grad.abs().max()))

    # the tolerance sees attention that crosses into the previous sequence: the same packed row with its
    # boundaries forgotten (one causal sequence of them all) moves the later sequences' log-probs far past it
    n = sum(5 + k for k in LENGTHS)
    crossing, _ = logprobs_and_grad(policy, mb, padded=False, cu_seq_lens_q=torch.tensor([0, n], dtype=torch.int32),
                                    cu_seq_lens_k=torch.tensor([0, n], dtype=torch.int32), max_length_q=n)
    first = LENGTHS[0]
    # the first sequence attends to nothing before it: the same attention, but one SDPA call over the whole row
    # against one over the sequence alone, which the CPU's kernel blocks by length (and by the vector width ATen
    # dispatches to: AVX512 moves it by 1.7 ulps of the largest log-prob, 2.9e-6; AVX2 and the default not at
    # all), so the fp32 sums run in another order: the same few ulps as above, not bit for bit
    atol = 8 * eps * float(padded_lp.abs().max())
    torch.testing.assert_close(crossing[:first], packed_lp[:first], rtol=0, atol=atol)
    assert (crossing[first:] - padded_lp[first:]).abs().max() > 1e3 * atol


def test_deterministic_packed_attention_is_the_math_kernel_and_repeats_bit_for_bit(policy):
    mb = batch(policy.config.vocab_size)
    default_lp, _ = logprobs_and_grad(policy, mb, padded=False)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [logprobs_and_grad(policy, mb, padded=False) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(runs[0][0], default_lp, rtol=0, atol=8 * eps * float(default_lp.abs().max()))


def test_attention_kind_names_the_kernel_the_memory_model_counts():
    def kind(padded, deterministic, cuda):
        return batching.attention_kind(argparse.Namespace(padded=padded, deterministic=deterministic), cuda)

    assert [kind(False, False, True), kind(False, True, True), kind(False, False, False)] == ["flash", "math", "math"]
    assert [kind(True, False, True), kind(True, True, True)] == ["sdpa-masked", "eager"]
    assert batching.attention_implementation(argparse.Namespace(padded=True, deterministic=True)) == "eager"
    assert batching.attention_implementation(argparse.Namespace(padded=False, deterministic=True)) == "packed"


def test_the_cuda_branch_calls_torchs_varlen_kernel_as_documented(policy, monkeypatch):
    """What differs on CUDA, simulated on the CPU: packed_attention's flash branch hands torch.nn.attention.varlen's
    kernel what torch 2.13 documents (nn/attention/varlen.py), and a kernel that keeps that contract, here
    scaled_dot_product_attention per sequence, gives the padded rows' log-probs and gradient."""
    import torch.nn.attention.varlen as varlen

    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False, **rest):
        # [T, heads, head_dim] tensors (contiguous), int32 cumulative lengths ending at T, the longest sequence,
        # causal as window (-1, 0), grouped-query attention by flag, nothing else asked
        assert q.dim() == k.dim() == v.dim() == 3 and all(x.is_contiguous() for x in (q, k, v))
        assert cu_q.dtype == cu_k.dtype == torch.int32 and torch.equal(cu_q, cu_k) and cu_q[-1] == q.shape[0]
        assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        assert window_size == (-1, 0) and enable_gqa and q.shape[1] % k.shape[1] == 0 and not rest
        assert scale == policy.model.layers[0].self_attn.scaling
        calls.append(tuple(q.shape))
        bounds = cu_q.tolist()
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=True).transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])])

    monkeypatch.setattr(varlen, "varlen_attn", kernel)
    monkeypatch.setattr(batching, "flash_kernel_applies", lambda q: True)
    mb = batch(policy.config.vocab_size)
    lp, grad = logprobs_and_grad(policy, mb, padded=False)
    n = sum(5 + k for k in LENGTHS)
    heads = policy.config.num_attention_heads
    assert calls == [(n, heads, policy.config.head_dim)] * policy.config.num_hidden_layers  # one call a layer
    monkeypatch.undo()
    padded_lp, padded_grad = logprobs_and_grad(policy, mb, padded=True)
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(lp, padded_lp, rtol=0, atol=8 * eps * float(padded_lp.abs().max()))
    torch.testing.assert_close(grad, padded_grad, rtol=1e-4, atol=1e-5 * float(padded_grad.abs().max()))


def test_the_measured_budget_reads_the_engine_as_deepspeed_names_it(monkeypatch):
    """memory_to_update's sizing on CUDA, simulated: the engine's ZeRO-3 live-parameter limit, reduce bucket and
    ranks by DeepSpeed's own accessors, the free memory from torch.cuda.mem_get_info, less Adam's moments until the
    optimizer has stepped (torch's AdamW makes them at its first step)."""
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine

    from scripts.bench_step import SHAPES

    for accessor in ("zero_max_live_parameters", "zero_reduce_bucket_size", "zero_offload_optimizer"):
        assert callable(getattr(DeepSpeedEngine, accessor))
    config = SimpleNamespace(**SHAPES["qwen2.5-3b"])
    state = {}
    engine = SimpleNamespace(module=SimpleNamespace(config=config, is_gradient_checkpointing=True), world_size=4,
                             zero_max_live_parameters=lambda: 2 * 10**8, zero_reduce_bucket_size=lambda: 5 * 10**7,
                             zero_offload_optimizer=lambda: None,
                             optimizer=SimpleNamespace(optimizer=SimpleNamespace(state=state)))
    free = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, 141 * 2**30))
    for deterministic in (False, True):
        args = argparse.Namespace(logprob_chunk=1024, padded=False, deterministic=deterministic)
        kind = "math" if deterministic else "flash"
        model = memory.memory_model(config, True, 1024, kind, 4096, 2e8, 4, 5e7)
        adam = model["optimizer states"]
        assert adam == 8 * math.ceil(model["params"] / 4)  # two fp32 moments of this rank's quarter
        state.clear()  # before the first step: the budget leaves room for Adam's moments
        budget, measured = memory.measured_budget(engine, args, 4096)
        assert measured == model and budget == memory.token_budget(model, free, 4096, to_come=adam)
        transient = model["fixed"] + model["gradients in flight"]
        assert transient + budget * model["per_token"] <= 0.9 * (free - adam)
        state["p"] = {"exp_avg": None}  # once it has stepped (or a checkpoint loaded them), they are held already
        after, _ = memory.measured_budget(engine, args, 4096)
        assert after == memory.token_budget(model, free, 4096) > budget
        assert (after - budget) * model["per_token"] == pytest.approx(0.9 * adam, abs=model["per_token"])


def test_an_older_torchs_varlen_kernel_is_not_called(monkeypatch):
    # a node's own torch whose varlen_attn lacks the causal window or GQA (or has none): one sequence at a time
    import torch.nn.attention.varlen as varlen

    assert batching.varlen_kernel_here()  # the pinned torch 2.13's has both
    monkeypatch.setattr(varlen, "varlen_attn", lambda query, key, value, cu_seq_q, cu_seq_k, max_q, max_k: None)
    batching.varlen_kernel_here.cache_clear()
    try:
        assert not batching.varlen_kernel_here()
    finally:
        batching.varlen_kernel_here.cache_clear()
