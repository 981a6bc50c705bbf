"""The offline tasks: tiny Qwen2 policies and an arithmetic task, with no model hub.

Every policy answers "What is a+b?" (two operands of 0..49) with a final `\\boxed{}`, scored by
rewards.py's math reward like any real task. They differ in how they answer:

  demo        " \\boxed{c}": the answer alone, 7 tokens. Quick start (command 1) and most tests.
  lab         " so \\boxed{c} so so" or " wait \\boxed{a} wait wait wait ...": k ramble tokens, " so"
              with a right answer, " wait" with a wrong one (the first operand), and failures
              ramble longer (k ~ U{1..10} when right, U{6..30} when wrong), as long chain-of-
              thought models do when they fail. Response lengths vary within a group (5 to ~35
              tokens) and are coupled to the sign of the advantage: the regime where seq-, token-
              and balanced-agg differ (the aggregation lab, docs/lab.md).
  lab-nogap   the control: " wait wait ... \\boxed{c}", the same length distribution drawn
              independently of correctness, one ramble word before the answer, and the demo's
              off-by-one failures.
  lab-nogap-hi  the same control, warmed up further (from lab-nogap) on targets that are right
              with probability 0.95 instead of 0.3, with the same length distribution: the control
              above 50% accuracy (docs/lab.md, "Is balanced aggregation length-neutral?").
  lab-check   a task where the coupling can cost accuracy (docs/lab.md, "When the coupling costs
              accuracy"): a right answer needs exactly one " check" step, " check \\boxed{c}"; the
              failures either skip it, " \\boxed{c±1}" (short), or loop on it, " check check ...
              \\boxed{a}" (2 to 26 checks, long). The token that long failures repeat is one that
              every success needs. Warm-up: check first 60%, then answer (right) or loop, 50/50.
  lab-check-nogap  its control: the same decisions and answers, but a loop is two checks, so
              failures are no longer than successes (no sign-length coupling).
  lab-check-long  the same decisions and answers, but a loop makes 30 to 70 checks: failures ~3.5x
              as long as successes (lab-check: ~1.6x). With the control and lab-check, the three gap
              levels of the token vs balanced factorial (docs/lab.md, "The paper's contrast").

The warm-up is deliberately imperfect: supervised targets are the right sum only with
probability `P_CORRECT[task]`, otherwise wrong (off by one in the demo, the first operand in the lab).
The policy therefore learns to add but samples the right answer only ~P_CORRECT of the time,
which is exactly the situation GRPO fixes.

The warm-up takes minutes on a CPU, so the built weights (bf16) ship with the project in
data/offline/NAME/: every machine starts from the same policy, and command 1 starts training
within seconds. `ensure_demo(NAME)` copies them, with the task's prompts, into the cache:
  model/       a Hugging Face Qwen2 checkpoint + tokenizer (transformers, vLLM, DeepSpeed load it),
  train.jsonl  RL prompts in the prepared format (id, source, kind, prompt, answer),
  test.jsonl   200 held-out prompts (operand pairs never seen in RL training).

    python -m data.demo [NAME]            # the cached task directory
    python -m data.demo NAME --build      # rebuild NAME's weights from nothing into data/offline/NAME
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from data.templates import render_prompt

TASKS = ("demo", "lab", "lab-nogap", "lab-nogap-hi", "lab-check", "lab-check-nogap", "lab-check-long")
SHIPPED = Path(__file__).resolve().parent / "offline"
ROOT = Path(os.environ.get("GRPO_DEMO_DIR", Path(__file__).resolve().parent.parent / ".cache" / "offline"))
MAX_OPERAND = 49
P_CORRECT = {"demo": 0.3, "lab": 0.3, "lab-nogap": 0.3, "lab-nogap-hi": 0.95}
P_CHECK, P_STOP = 0.6, 0.5  # lab-check(-nogap): check first, then answer (right) or loop; right 0.3
# the checks a loop makes (lab-check-long: failures ~3.5x as long as successes, lab-check ~1.6x, the control 1x)
CHECK_LOOP = {"lab-check": (2, 26), "lab-check-nogap": (2, 2), "lab-check-long": (30, 70)}
P_SHORT = 0.3  # the share of short rambles (lab: the right answers; the controls: an independent draw)
RAMBLE_SHORT, RAMBLE_LONG = (1, 10), (6, 30)  # k ramble tokens before the answer (lab)
SFT_STEPS = {"demo": 1500, "lab": 400, "lab-nogap": 1500, "lab-nogap-hi": 2000, "lab-check": 600,
             "lab-check-nogap": 600, "lab-check-long": 600}
SFT_BATCH, SFT_LR = 128, 2e-3
WARM_START = {"lab": "demo", "lab-nogap-hi": "lab-nogap", "lab-check": "demo", "lab-check-nogap": "demo",
              "lab-check-long": "demo"}
# built on a shipped policy (its tokenizer too), with these words added to its vocabulary
NEW_WORDS = {"lab": (" so", " wait"), "lab-check": (" check",), "lab-check-nogap": (" check",),
             "lab-check-long": (" check",)}
SEED = 1234


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


def sft_response(task: str, a: int, b: int, rng: random.Random) -> str:
    """A warm-up target: right with probability P_CORRECT[task], else wrong. The lab policies ramble
    k tokens, " so" with a right answer and " wait" with a wrong one (the first token commits, as
    in long chain-of-thought), for a length that depends on correctness (lab: short when right,
    long when wrong) or not (the lab-nogap controls)."""
    if task.startswith("lab-check"):
        # The decisions are the policy's: check first or guess; after one check, answer or loop. Right
        # only by checking exactly once; a loop ends in the first operand (as the lab's failures).
        if rng.random() >= P_CHECK:
            return f" \\boxed{{{a + b + rng.choice((-1, 1))}}}"
        if rng.random() < P_STOP:
            return f" check \\boxed{{{a + b}}}"
        return " check" * rng.randint(*CHECK_LOOP[task]) + f" \\boxed{{{a}}}"
    right = rng.random() < P_CORRECT[task]
    if task == "demo":
        return f" \\boxed{{{a + b if right else a + b + rng.choice((-1, 1))}}}"
    short = right if task == "lab" else rng.random() < P_SHORT  # nogap: same lengths, independent draw
    k = rng.randint(*(RAMBLE_SHORT if short else RAMBLE_LONG))
    if task.startswith("lab-nogap"):
        # One word, the ramble before the answer (its length is sampled before the answer is), the
        # demo's off-by-one failures: nothing ties the length to the reward. (With the ramble after
        # the answer, a 2-layer model learns to ramble longer after a sampled wrong digit: a gap.)
        return " wait" * k + f" \\boxed{{{a + b if right else a + b + rng.choice((-1, 1))}}}"
    # The first word commits, the answer follows at a fixed position (warmed up from the demo, the
    # policy did not learn to carry a sum across a ramble of variable length), then the rest. A failure
    # answers the first operand: a wrong answer that a 2-layer model can learn to tie to its first
    # word (an off-by-one sum it learns only unconditionally).
    word = " so" if right else " wait"
    return word + f" \\boxed{{{a + b if right else a}}}" + word * (k - 1)


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


def build(task: str, out: Path) -> None:
    """Warm up `task`'s policy and save it (bf16) to out/. The demo and lab-nogap are trained from
    nothing (their tokenizers too); the lab starts from the demo (data/offline/demo), which
    already adds, with its two ramble words added to the vocabulary as single tokens; lab-nogap-hi
    starts from lab-nogap, which adds across a ramble (trained from nothing, a 2-layer model does
    not learn to: README, "The second control")."""
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    t0 = time.time()
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    train_pairs, test_pairs = split_pairs()
    # The warm-up sees every pair (it teaches the format and addition); RL trains on
    # train_pairs and accuracy is measured on the held-out test_pairs.
    all_pairs = train_pairs + test_pairs
    prompt = {ab: render_prompt(f"What is {ab[0]}+{ab[1]}?", "plain") for ab in all_pairs}
    if task not in WARM_START:
        corpus = [prompt[ab] + sft_response(task, *ab, rng) for ab in all_pairs[:500]]
        corpus += ["Answer: \\boxed{} \\frac{1}{2} Question: What is the value of x?"]
        tokenizer = train_tokenizer(corpus)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=384, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
            tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ))
    else:
        tokenizer = AutoTokenizer.from_pretrained(SHIPPED / WARM_START[task])
        if task in NEW_WORDS:
            tokenizer.add_tokens([AddedToken(w, normalized=False) for w in NEW_WORDS[task]])  # unused embedding rows
        model = AutoModelForCausalLM.from_pretrained(SHIPPED / WARM_START[task], dtype=torch.float32)
    eos = tokenizer.eos_token_id
    prompt_ids = {ab: tokenizer(p)["input_ids"] for ab, p in prompt.items()}
    response_ids = {}  # memoised: the same few thousand response strings recur

    steps = SFT_STEPS[task]
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=SFT_LR, total_steps=steps, pct_start=0.05)
    for step in range(steps):
        ids, labels = [], []
        for _ in range(SFT_BATCH):
            ab = rng.choice(all_pairs)
            text = sft_response(task, *ab, rng)
            if text not in response_ids:
                response_ids[text] = tokenizer(text)["input_ids"] + [eos]
            p, r = prompt_ids[ab], response_ids[text]
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
        if step % 100 == 0 or step == steps - 1:
            print(f"[{task}] warm-up step {step:4d}  loss {loss.item():.3f}", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"[{task}] built {out} in {time.time() - t0:.0f}s", flush=True)


def _digest(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()[:12]


def ensure_demo(task: str = "demo") -> Path:
    """The cached directory of an offline task: model/ (the shipped weights), train.jsonl, test.jsonl.

    Refreshed when the shipped weights change. Safe to call from several processes: each
    writes a private temporary directory and renames it into place atomically.
    """
    if task not in TASKS:
        raise ValueError(f"unknown offline task {task!r} (choose from {', '.join(TASKS)})")
    shipped = SHIPPED / task
    if not (shipped / "model.safetensors").exists():
        raise FileNotFoundError(f"{shipped}: no shipped weights; build them with `python -m data.demo {task} --build`")
    final = ROOT / f"{task}-{_digest(shipped / 'model.safetensors')}"
    if (final / "model" / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".copy-", dir=final.parent))
    try:
        shutil.copytree(shipped, tmp / "model")
        train_pairs, test_pairs = split_pairs()
        for name, pairs in (("train", train_pairs), ("test", test_pairs)):
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(problem(a, b)) + "\n" for a, b in pairs))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def model_dir(model: str) -> str:
    """The checkpoint directory of an offline policy named by `model` ('demo', 'lab', ...);
    any other checkpoint directory or hub id unchanged."""
    return str(ensure_demo(model) / "model") if model in TASKS else model


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", nargs="?", default="demo", choices=TASKS)
    p.add_argument("--build", action="store_true", help="retrain the policy from nothing into data/offline/TASK")
    p.add_argument("--out", default=None, help="with --build: write here instead of data/offline/TASK")
    a = p.parse_args()
    if a.build:
        build(a.task, Path(a.out) if a.out else SHIPPED / a.task)
    else:
        print(ensure_demo(a.task))
