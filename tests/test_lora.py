"""LoRA (--lora-rank, through PEFT) without the engines: the weights the trainer syncs into vLLM and exports are
the merged policy its forward computes, under the base model's own names; a run's rank and alpha are its
identity; the memory model counts only the adapters' optimizer states. The engines' side (vLLM sampling the
merged policy, the exported checkpoint in plain transformers, the gradient's invariance) is in
tests/test_train_integration.py and tests/test_invariance.py."""

import re
from types import SimpleNamespace

import pytest
import torch
from conftest import check_output_dir

import train_grpo
from grpo_utils import memory
from grpo_utils.batching import micro_batching


def adapted(demo_dir, rank: int = 2, alpha: float = 32.0):
    """The demo policy with adapters of `rank` on every linear layer of the decoder, as build_trainer makes them,
    but with B random (PEFT's init_lora_weights=False): an adapted policy that differs from the base."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_dir / "model", dtype=torch.float32)
    torch.manual_seed(0)
    return train_grpo.with_adapters(base, rank, alpha, init_lora_weights=False)


def test_the_synced_and_exported_weights_are_the_merged_policy(demo_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = adapted(demo_dir)
    weights = dict(train_grpo.policy_weights(SimpleNamespace(module=model)))
    base = AutoModelForCausalLM.from_pretrained(demo_dir / "model", dtype=torch.float32)
    assert set(weights) == {k for k, _ in base.named_parameters()}  # the base's names: vLLM's loader takes them
    linear = [k for k in weights if re.search(r"\.(q|k|v|o|gate|up|down)_proj\.weight$", k)]
    assert len(linear) == 7 * base.config.num_hidden_layers
    # every adapted layer moved, nothing else: W + (alpha / R) B A
    moved = {k for k, p in base.named_parameters() if not torch.equal(weights[k], p.data)}
    assert moved == set(linear)
    # loaded in plain transformers, they give the adapted model's log-probs, which differ from the base's (fp32:
    # x (W + s B A)^T against x W^T + s (x A^T) B^T, rounding apart)
    ids = torch.randint(1, base.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = base(input_ids=ids).logits.log_softmax(-1)
        missing, unexpected = base.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding, sent once
        want, got = model(input_ids=ids).logits.log_softmax(-1), base(input_ids=ids).logits.log_softmax(-1)
    assert (want - got).abs().max() < 1e-4 < (want - before).abs().max()
    # the export: the base model's save_pretrained of the merged weights loads as a plain checkpoint
    model.get_base_model().save_pretrained(tmp_path / "export", state_dict=weights, safe_serialization=True)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(back(input_ids=ids).logits.log_softmax(-1), got, atol=1e-6)


def test_a_resume_with_another_rank_or_alpha_is_another_run(tmp_path):
    from test_bad_input import checkpointed_run

    checkpointed_run(tmp_path / "run")  # full fine-tuning
    for flags, shown in ((["--lora-rank", "8"], "--lora-rank 0 -> 8"),
                         (["--lora-alpha", "16"], "--lora-alpha 32.0 -> 16.0")):
        args = train_grpo.parse_args(["--output-dir", str(tmp_path / "run"), "--steps", "3", "--resume", *flags])
        with pytest.raises(ValueError, match=re.escape(f"other arguments ({shown}), which no resume changes")):
            check_output_dir(args, tmp_path / "run", 1)


def test_the_memory_model_counts_the_adapters_states_only():
    from transformers import Qwen2Config

    from scripts.bench_step import SHAPES

    cfg = Qwen2Config(**SHAPES["qwen2.5-7b"])
    full = memory.memory_model(cfg, True, 1024, "flash", 4096)
    lora = memory.memory_model(cfg, True, 1024, "flash", 4096, lora_rank=8)
    h, i, q, kv, layers = 3584, 18944, 3584, 512, 28
    adapters = layers * 8 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))  # R (in + out) a layer
    assert lora["trained"] == adapters and full["trained"] == full["params"]
    assert lora["params"] == full["params"] + adapters
    for group, per_param in (("master weights", 4), ("gradient partitions", 4), ("optimizer states", 8)):
        assert lora[group] == per_param * adapters  # fp32 master weights, gradients, Adam's two moments
    assert lora["parameter partitions"] == 2 * lora["params"]  # bf16: the frozen base and the adapters
    assert lora["per_token"] - full["per_token"] == 2 * 8 * 7  # each adapted layer's A x, one layer held


def test_the_kl_reference_under_lora_is_the_base_with_the_adapters_off(demo_dir, monkeypatch):
    # --kl-coef with --lora-rank loads no second model: update takes the reference log-probs from the policy with
    # its adapters scaled to zero, which are the base model's; after them the adapters are on again
    from transformers import AutoModelForCausalLM

    from scripts.bench_step import synthetic_rollouts

    def engine(model):  # what update reads of a DeepSpeed engine: the call, .module, train()
        def call(**inputs):
            return model(**inputs)

        call.module, call.train = model, model.train
        return call

    model = adapted(demo_dir)
    args = train_grpo.parse_args(["--model", "demo", "--lora-rank", "2", "--kl-coef", "0.01", "--minibatches", "1",
                                  "--group-size", "4", "--padded"])  # padded rows: the models' own attention
    batching, cpu = micro_batching(args), torch.device("cpu")
    rollouts = synthetic_rollouts(8, 4, 8, model.config.vocab_size, seed=0)
    monkeypatch.setattr(train_grpo, "update_minibatch", lambda *a: {"skipped": 0})  # the reference alone
    adv = torch.tensor([1.0, -1.0] * 4, dtype=torch.float64)
    train_grpo.update(engine(model), None, rollouts, adv, args, batching, cpu, 1, {})
    base = AutoModelForCausalLM.from_pretrained(demo_dir / "model", dtype=torch.float32)
    for policy, key in ((base, "base_logp"), (model, "policy_logp")):
        train_grpo.fill_logprobs(engine(policy), rollouts, key, args, batching, cpu)
    for r in rollouts:
        torch.testing.assert_close(r["ref_logp"], r["base_logp"], rtol=0, atol=1e-5)
    assert max((r["policy_logp"] - r["base_logp"]).abs().max() for r in rollouts) > 1e-3  # the adapters on again
