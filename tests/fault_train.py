"""train_grpo.py with a fault injected from outside, for the crash-safety and mismatch tests (the
trainer itself reads no fault switch). Launched as `deepspeed tests/fault_train.py <trainer flags>`:

    GRPO_FAULT_NAN_STEP=k       step k's advantages are NaN: a poisoned batch
    GRPO_FAULT_KILL_IN_SAVE=k   every rank SIGKILLs itself inside step k's save, once the checkpoint's
                                files are written and before it is renamed into place
    GRPO_FAULT_SCALE_VLLM=s     after every weight sync vLLM's final norm is scaled by s, so that its
                                logits are s times the trainer's: a rollout-trainer mismatch
    GRPO_FAULT_INF_LR_STEP=k    the first optimizer update from step k on runs at lr = inf: an update that
                                makes the weights non-finite from finite gradients
    GRPO_FAULT_KILL_RANK=r:k    rank r SIGKILLs itself in step k, its rollout done (as the OOM killer ends a
                                rank: without a word, its peers left in the step's next collective)
    GRPO_FAULT_UNFILE=1         ... and removes its .rankN.pid first, as a user's clean-up by hand would
    GRPO_FAULT_STALL=1          ... while every other rank blocks in a C call that never returns to Python (a
                                mutex locked twice), as a survivor under NCCL waits in a CUDA synchronisation:
                                no signal handler of its main thread can run
"""

import ctypes
import functools
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_grpo  # noqa: E402
from grpo_utils import checkpoints, distributed  # noqa: E402

NAN_STEP = int(os.environ.get("GRPO_FAULT_NAN_STEP", "-1"))
KILL_STEP = int(os.environ.get("GRPO_FAULT_KILL_IN_SAVE", "-1"))
SCALE = float(os.environ.get("GRPO_FAULT_SCALE_VLLM", "1"))
INF_LR_STEP = int(os.environ.get("GRPO_FAULT_INF_LR_STEP", "-1"))
KILL_RANK, KILL_RANK_STEP = map(int, os.environ.get("GRPO_FAULT_KILL_RANK", "-1:-1").split(":"))
current = {"step": 0}


def rollout(llm, rows, args, step, first_index):
    current["step"] = step
    return real_rollout(llm, rows, args, step, first_index)


def advantages(*a, **kw):
    if current["step"] == KILL_RANK_STEP and int(os.environ.get("RANK", "0")) == KILL_RANK:
        if os.environ.get("GRPO_FAULT_UNFILE"):
            distributed.rank_file(distributed.LAUNCH["out_dir"], KILL_RANK).unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    elif current["step"] == KILL_RANK_STEP and os.environ.get("GRPO_FAULT_STALL"):
        libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # a default mutex locked again by its owner: blocked for good, GIL released
    adv = real_advantages(*a, **kw)
    return adv * float("nan") if current["step"] == NAN_STEP else adv


def update_minibatch(engine, batch, weights, args, *rest):
    if 0 <= INF_LR_STEP <= current["step"] and not current.get("poisoned"):
        current["poisoned"] = True
        for group in engine.optimizer.param_groups:  # the schedule sets it back after this update
            group["lr"] = float("inf")
    return real_update(engine, batch, weights, args, *rest)


def save_checkpoint(engine, tokenizer, root, step, *rest):
    import torch.distributed as dist

    real_barrier, calls = dist.barrier, []

    def barrier(*a, **kw):  # the save's second barrier: every file written, nothing renamed yet
        calls.append(1)
        if step == KILL_STEP and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_barrier(*a, **kw)

    dist.barrier = barrier
    try:
        return real_save(engine, tokenizer, root, step, *rest)
    finally:
        dist.barrier = real_barrier


def _scale_final_norm(model, scale: float) -> None:
    for name, p in model.named_parameters():
        if name.endswith("model.norm.weight"):
            p.data.mul_(scale)


def sync_weights_to_vllm(engine, llm):
    real_sync(engine, llm)
    llm.apply_model(functools.partial(_scale_final_norm, scale=SCALE))


real_rollout, real_advantages = train_grpo.rollout, train_grpo.advantages
real_save, real_sync = checkpoints.save_checkpoint, train_grpo.sync_weights_to_vllm
real_update = train_grpo.update_minibatch
train_grpo.rollout, train_grpo.advantages, train_grpo.update_minibatch = rollout, advantages, update_minibatch
checkpoints.save_checkpoint = save_checkpoint  # what the trainer's save_step calls
if SCALE != 1:
    train_grpo.sync_weights_to_vllm = sync_weights_to_vllm

if __name__ == "__main__":
    train_grpo.main()
    train_grpo.exit_without_teardown()
