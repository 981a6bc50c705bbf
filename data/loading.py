"""The model directory, tokenizer and prompts a run trains and evaluates on, checked before any engine starts."""

from __future__ import annotations

import sys

from data.demo import model_dir
from data.prepare import load_rows
from data.templates import prompt_ids
from grpo_utils.common import first_line
from rewards import SandboxUnavailable, sandbox_mode


def load_prompts(
    spec: str, tokenizer, args, limit: int | None = None, train: bool = False
) -> tuple[list[dict], int]:
    """Rows with their rendered, tokenized prompt; drops (and counts) over-long prompts.
    train: a training set, deduplicated by prompt (held-out sets are taken as published)."""
    rows, dropped = [], 0
    for row in load_rows(spec, train=train):
        ids = prompt_ids(row, args.template, tokenizer)
        if len(ids) > args.max_prompt_len:
            dropped += 1
            continue
        rows.append({**row, "prompt_ids": ids})
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"dataset {spec}: no prompts left ({dropped} longer than --max-prompt-len)")
    return rows, dropped


def load_data(args, local_rank: int) -> tuple[str, object, list[dict], tuple[int, int], list[dict]]:
    """(model path, tokenizer, training rows, training and held-out prompts dropped as too long, held-out rows); a
    bad input stops every rank with one line before any engine starts."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    try:
        if local_rank == 0:
            model_dir(args.model)  # an offline policy is copied into this node's cache once
        dist.barrier()
        model_path = model_dir(args.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        context = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
        if context and args.max_prompt_len + args.max_response_len > context:
            raise ValueError(f"--max-prompt-len + --max-response-len = {args.max_prompt_len + args.max_response_len} "
                             f"exceeds the model's context of {context} tokens")
        train_rows, dropped = load_prompts(args.dataset, tokenizer, args, train=True)
        eval_rows, eval_dropped = load_prompts(args.eval_dataset, tokenizer, args, args.eval_limit) \
            if args.eval_dataset else ([], 0)
        if any(r["kind"] == "code" for r in train_rows + eval_rows):
            sandbox_mode()  # code rewards fail closed without bubblewrap: say so before any engine starts
    except (ValueError, OSError, SandboxUnavailable) as e:
        sys.exit(f"train_grpo.py: error: {first_line(e)}")
    return model_path, tokenizer, train_rows, (dropped, eval_dropped), eval_rows
