"""The offline demo: a tiny Qwen2 policy and an arithmetic task, built from nothing.

No model hub is needed. `ensure_demo()` builds (once, then cached) a directory with
  model/       a Hugging Face Qwen2 checkpoint + tokenizer that transformers, vLLM and
               DeepSpeed load like any other model,
  train.jsonl  RL prompts in the prepared format (id, source, kind, prompt, answer),
  test.jsonl   held-out prompts (operand pairs never seen in RL training).

The warm-up is deliberately imperfect: supervised targets are the right sum only with
probability `P_CORRECT`, otherwise off by one. The model therefore learns to add but
samples the right answer only ~P_CORRECT of the time, which is exactly the situation
GRPO fixes: sampled accuracy on held-out problems rises from ~0.3 towards 1 in a few
dozen steps. Everything is seeded, so the build is deterministic on a given machine.

    python -m data.demo            # build (or show) the cached demo
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from data.templates import render_prompt

VERSION = 1  # bump when anything below changes the built artefacts
ROOT = Path(os.environ.get("GRPO_DEMO_DIR", Path(__file__).resolve().parent.parent / ".cache" / "demo"))
MAX_OPERAND = 49
P_CORRECT = 0.3
SFT_STEPS, SFT_BATCH, SFT_LR = 1500, 128, 2e-3
SEED = 1234


def demo_dir() -> Path:
    return ROOT / f"v{VERSION}"


def problem(a: int, b: int) -> dict:
    return {
        "id": f"demo/{a}+{b}",
        "source": "demo_add",
        "kind": "math",
        "prompt": f"What is {a}+{b}?",
        "answer": str(a + b),
    }


def split_pairs(seed: int = SEED) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All operand pairs, shuffled; 200 held out for evaluation, the rest for RL."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[200:], pairs[:200]


def sft_example(a: int, b: int, rng: random.Random) -> tuple[str, str]:
    """(prompt text, target response) with the noisy warm-up label."""
    c = a + b
    if rng.random() >= P_CORRECT:
        c += rng.choice((-1, 1))
    return render_prompt(f"What is {a}+{b}?", "plain"), f" \\boxed{{{c}}}"


def train_tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte-level so any text (real benchmarks too) is encodable; single digits so numbers
    # are spelled digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def build(out: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t0 = time.time()
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    train_pairs, test_pairs = split_pairs()
    # The warm-up sees every pair (it teaches the format and addition); RL trains on
    # train_pairs and accuracy is measured on the held-out test_pairs.
    all_pairs = train_pairs + test_pairs
    corpus = [p + r for p, r in (sft_example(a, b, rng) for a, b in all_pairs[:500])]
    corpus += ["Answer: \\boxed{} \\frac{1}{2} Question: What is the value of x?"]
    tokenizer = train_tokenizer(corpus)

    config = Qwen2Config(
        vocab_size=384, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=SFT_LR, total_steps=SFT_STEPS, pct_start=0.05)
    eos = tokenizer.eos_token_id
    for step in range(SFT_STEPS):
        batch = [sft_example(*rng.choice(all_pairs), rng) for _ in range(SFT_BATCH)]
        ids, labels = [], []
        for prompt, response in batch:
            p = tokenizer(prompt)["input_ids"]
            r = tokenizer(response)["input_ids"] + [eos]
            ids.append(p + r)
            labels.append([-100] * len(p) + r)  # loss on the response only
        width = max(map(len, ids))
        input_ids = torch.tensor([x + [eos] * (width - len(x)) for x in ids])
        label_t = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        attn = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        loss = model(input_ids=input_ids, attention_mask=attn, labels=label_t).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 250 == 0 or step == SFT_STEPS - 1:
            print(f"[demo] warm-up step {step:4d}  loss {loss.item():.3f}", flush=True)

    (out / "model").mkdir(parents=True)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    for name, pairs in (("train", train_pairs), ("test", test_pairs)):
        with open(out / f"{name}.jsonl", "w") as f:
            for a, b in pairs:
                f.write(json.dumps(problem(a, b)) + "\n")
    print(f"[demo] built {out} in {time.time() - t0:.0f}s", flush=True)


def ensure_demo() -> Path:
    """Return the demo directory, building it first if it is not cached yet.

    Safe to call from several processes: each builds into a private temporary directory
    and the first finished one is renamed into place atomically.
    """
    final = demo_dir()
    if (final / "model" / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    print(ensure_demo())
