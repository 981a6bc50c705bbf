"""Prompt templates shared by training (train_grpo.py) and evaluation (evaluate.py).

A prepared row carries the problem as the user would ask it (`prompt`); the template
decides how it is shown to the model. Pick one with `--template NAME`.
"""

from __future__ import annotations

from rewards import KINDS

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# DAPO-Math-17k's own user prompt (the prepared DAPO rows already carry it verbatim).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    'of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n'
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

TEMPLATES = ("plain", "chat", "boxed", "dapo")

# A kind with an instruction of its own (rewards.KINDS: code's, CODE_INSTRUCTION) gets it instead of any math
# instruction, under every template. Code rows with stdin/stdout tests also carry data.prepare.STDIN_INSTRUCTION.


def _chat(tokenizer, content: str) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "this tokenizer has no chat template; use --template plain for base/completion models"
        )
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_prompt(prompt: str, template: str, tokenizer=None, kind: str = "math") -> str:
    """Turn a row's prompt into the exact text the policy continues.

    Math rows (kind "math"):
    plain: completion format for base models ("Question: ...\\nAnswer:").
    chat:  the tokenizer's chat template around the prompt as given (DAPO rows keep their
           `Answer:` instruction this way).
    boxed: chat template, prompt + the Qwen-Math "\\boxed{}" instruction.
    dapo:  chat template, prompt wrapped in DAPO's prefix/suffix unless it already has them.
    A kind with its own instruction (code's CODE_INSTRUCTION, rewards.KINDS): the prompt + it, in the chat
    template (chat, boxed, dapo) or as "Question: ...\\nSolution:" (plain); never a math instruction.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")
    if kind not in KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; one of {', '.join(KINDS)}")
    if instruction := KINDS[kind]["instruction"]:
        if instruction not in prompt:
            prompt = f"{prompt}\n\n{instruction}"
        return f"Question: {prompt}\nSolution:" if template == "plain" else _chat(tokenizer, prompt)
    if template == "plain":
        return f"Question: {prompt}\nAnswer:"
    if template == "chat":
        return _chat(tokenizer, prompt)
    if template == "boxed":
        return _chat(tokenizer, f"{prompt}\n{BOXED_INSTRUCTION}")
    if template == "dapo":
        if not prompt.startswith(DAPO_PREFIX):
            prompt = DAPO_PREFIX + prompt + DAPO_SUFFIX
        return _chat(tokenizer, prompt)
    raise ValueError(f"unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")


def prompt_ids(row: dict, template: str, tokenizer) -> list[int]:
    """Token ids of a row's rendered prompt; the template's text already holds any special tokens."""
    text = render_prompt(row["prompt"], template, tokenizer, row["kind"])
    return tokenizer(text, add_special_tokens=False)["input_ids"]
