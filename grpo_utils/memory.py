"""Memory: what a micro-batch of the update holds on the device (the model, in groups), the token budget sized
from it, and the check that a model fits the device before any engine starts."""

from __future__ import annotations

import math

import torch

from grpo_utils.batching import attention_kind

# ZeRO-3 waits for its oldest reduction once more than 2 are outstanding (stage3.py's max_param_reduce_events): up
# to 3 are in flight on CUDA's reduce stream
REDUCTIONS_IN_FLIGHT = 3


def memory_model(config, checkpointing: bool, chunk: int, attention: str, longest: int,
                 live_params: float = 1e9, world: int = 1, reduce_bucket: float = 5e8, lora_rank: int = 0,
                 synchronized: bool = False) -> dict[str, float]:
    """Bytes a rank holds at the peak of a micro-batch's forward and backward on CUDA (bf16, fp32 norms), as
    'per_token' (times the micro-batch's tokens) and 'fixed', with the terms they sum; `attention`: the kernel
    the update runs (attention_kind). Per token:
      layer inputs    2 h (L + 1): checkpoints, the same tensors as output_hidden_states, and the final norm;
      layer(s)        a decoder layer's saved forward, per token: 2 RMSNorms (fp32 input and normed copies,
                      bf16 output: 10 h each), q, k, v (2 (q + 2 kv)), their rotated copies with rotate_half's
                      (4 (q + kv)), the attention output (2 q) and its fp32 log-sum-exp (4 heads), o_proj's
                      output and 2 residual sums (6 h), the MLP's gate, up, act(gate), product (8 i) and
                      output (2 h); once with checkpointing (the layer recomputed), L times without;
                      plus its backward's transients: the MLP's 3 gradients (6 i), the norms' fp32 ones (12 h);
      lm_head         its input rows and their gradient (4 h); per-token scalars (log-probs, losses: 96 B);
      attention       math / eager: a sequence's [heads, T, T] scores, fp32 softmax and bf16 probabilities
                      kept (6 B a score) per layer held, and 10 B of work, T <= `longest`: heads x longest x
                      (6 layers_held + 10) a token; flash: copies of q, k, v laid out for the kernel
                      (2 (q + 2 kv) per layer held; a margin: Qwen2's need none); sdpa-masked / eager:
                      keys and values repeated to every head (4 q per layer held); sdpa-masked: the [T, T]
                      boolean padding mask (longest).
    Fixed: the log-prob chunk's forward and recomputed backward (bf16 and fp32 logits, exp, the fp32 and bf16
    gradients: 16 B x chunk x vocab); the gathered embedding and lm_head with their bf16 gradients; ZeRO-3's
    live parameters (stage3_max_live_parameters, bf16).
    Resident, what a rank keeps between steps (ZeRO-3, `world` ranks, bf16 with fp32 accumulation; the groups of
    scripts/memory_ledger.py): the bf16 parameter partitions (2 P / world), the fp32 master weights (4 P / world),
    the fp32 gradient partitions (4 P / world), Adam's two moments (8 P / world) and the fp32 reduce bucket
    (reduce_bucket_size elements). All but Adam's moments exist once the engine is built: torch's AdamW creates its
    moments at the first optimizer step (DeepSpeed 0.19.8's stage3.py no longer steps it at start-up), so the
    memory free before that step lacks them ('first step').
    Transient beside the micro-batch's: the gradients in flight at the end of a backward, before ZeRO-3's
    reduce-scatter empties them into the partitions (bf16 gradients and their fp32 copies: 8 B an element, at most
    a reduce bucket's worth; measured on one rank, where the whole model is one bucket: 8 P), and beside them the
    gradients larger than the bucket, which ZeRO-3 reduces one by one outside it (stage3.py's
    __add_grad_to_ipg_bucket and __avg_scatter_grads): each holds its bf16 gradient and an fp32 copy (6 B an
    element), and 4 B more where the reduce-scatter makes a second fp32 buffer (reduce_scatter_coalesced's
    interleaved copy where `world` does not divide it; on a `synchronized` device, DeepSpeed's CPU accelerator,
    gloo's copy of its input: measured 8 B beside the bf16 2). They arrive in the backward's order (lm_head
    first, the layers from the last, the embedding last), and up to REDUCTIONS_IN_FLIGHT are outstanding on CUDA,
    one on a synchronized device: the most any such run of consecutive ones holds ('gradients beyond the
    bucket'). Then the optimizer
    step's own, when the micro-batches' are gone: the fp32 gradients it clips and the bf16 copy of the updated
    master weights ('step', at most 6 P / world; measured 4.0-5.6). A resume reads the checkpoint's fp32 master
    weights and moments (12 P / world) before it copies them in: host memory on CUDA, where DeepSpeed maps the
    files to the CPU ('checkpoint read').
    LoRA (`lora_rank` R > 0, adapters on the decoder's 7 linear layers): only the adapters' P_A = R x (in + out)
    parameters a layer are trained, so the master weights, gradients, moments, the gradients in flight, the step's
    transients and the checkpoint read count P_A where P stands above; the bf16 partitions hold both; each adapted
    layer keeps its A x (R bf16 values a token) for B's gradient; a resume also reads the frozen base's bf16
    values (ZeRO-3 saves frozen parameters' fragments with the module's states: 2 P / world)."""
    h, i, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * d, kv_heads * d
    held = 1 if checkpointing else layers
    layer = 10 * h + 10 * h + 2 * (q + 2 * kv) + 4 * (q + kv) + 2 * q + 4 * heads + 6 * h + 8 * i + 2 * h
    per_token = {"layer inputs": 2 * h * (layers + 1), "layers": held * layer + 6 * i + 12 * h,
                 "lm_head": 4 * h + 96}
    if attention == "flash":
        per_token["contiguous q, k, v"] = 2 * (q + 2 * kv) * held
    if attention in ("math", "eager"):
        per_token["attention scores"] = heads * longest * (6 * held + 10)
    if attention in ("sdpa-masked", "eager"):
        per_token["repeated keys and values"] = 4 * q * held
    if attention == "sdpa-masked":
        per_token["padding mask"] = longest
    if lora_rank:
        per_token["LoRA's A x"] = 2 * lora_rank * 7 * held
    embeddings = vocab * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    params = embeddings + layers * (h * q + 2 * h * kv + q + 2 * kv + q * h + 3 * h * i + 2 * h) + h
    adapters = layers * lora_rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    trained = adapters if lora_rank else params
    # the trained weight matrices in the order their gradients arrive (biases and norms are far below any bucket):
    # an untied lm_head, each layer's from down_proj back to q_proj, the embedding; an adapter's A is R x in, B out x R
    linears = [(i, h), (h, i), (h, i), (q, h), (h, kv), (h, kv), (h, q)]
    if lora_rank:
        arriving = [lora_rank * n for _ in range(layers) for pair in linears for n in pair]
    else:
        untied = [vocab * h] if embeddings > vocab * h else []
        arriving = untied + [a * b for _ in range(layers) for a, b in linears] + [vocab * h]
    beyond = [(6 + 4 * (synchronized or n % world != 0)) * n for n in arriving if n > reduce_bucket]
    run = 1 if synchronized else REDUCTIONS_IN_FLIGHT
    beyond_bytes = max((sum(beyond[k:k + run]) for k in range(len(beyond))), default=0)
    fixed = {"log-prob chunk": 16 * chunk * vocab, "embedding and lm_head": 4 * embeddings,
             "live parameters": 2 * min(live_params, params + adapters)}
    shard, trained_shard = math.ceil((params + adapters) / world), math.ceil(trained / world)
    frozen_shard = math.ceil(params / world) if lora_rank else 0
    resident = {"parameter partitions": 2 * shard, "master weights": 4 * trained_shard,
                "gradient partitions": 4 * trained_shard, "optimizer states": 8 * trained_shard,
                "reduce bucket": 4 * reduce_bucket}
    return {**per_token, **fixed, **resident, "per_token": sum(per_token.values()), "fixed": sum(fixed.values()),
            "params": params + adapters, "trained": trained, "resident": sum(resident.values()),
            "first step": resident["optimizer states"], "gradients beyond the bucket": beyond_bytes,
            "gradients in flight": 8 * min(trained, reduce_bucket),
            "step": 6 * trained_shard, "checkpoint read": 12 * trained_shard + 2 * frozen_shard}


MEMORY_SHARE = 0.9  # of the free memory: the caching allocator's fragmentation and what the model leaves out


# memory_model's groups: what a rank keeps between steps, and what a micro-batch holds whatever its tokens
RESIDENT_GROUPS = ("parameter partitions", "master weights", "gradient partitions", "optimizer states", "reduce bucket")


FIXED_GROUPS = ("log-prob chunk", "embedding and lm_head", "live parameters")


def resident_bytes(model: dict[str, float]) -> float:
    return sum(model[g] for g in RESIDENT_GROUPS)


def micro_batch_bytes(model: dict[str, float], tokens: int, backward: bool = True) -> float:
    """What a micro-batch of `tokens` holds beside the resident states (memory_model's groups): its fixed bytes,
    its tokens' and, with a backward, the gradients in flight at its end (in the reduce bucket and beyond it)."""
    fixed = sum(model[g] for g in FIXED_GROUPS)
    in_flight = model["gradients in flight"] + model["gradients beyond the bucket"]
    return fixed + model["per_token"] * tokens + (in_flight if backward else 0.0)


def token_budget(model: dict[str, float], free_bytes: int, longest: int, to_come: float = 0) -> int:
    """--micro-batch-tokens on CUDA by default: the tokens whose memory_model (the micro-batch's fixed bytes and
    the gradients in flight beside its tokens') fits MEMORY_SHARE of the memory free once the engines hold theirs
    (vLLM asleep), less `to_come`: what the trainer has yet to allocate for good (Adam's moments, before the
    first optimizer step). At least one longest sequence. Ranks may differ: each evens out its count of
    micro-batches with the others (rank_micro_batches)."""
    room = MEMORY_SHARE * (free_bytes - to_come) - micro_batch_bytes(model, 0)
    return int(max(room // model["per_token"], longest))


def trainer_memory(engine, args, longest: int, attention: str) -> dict[str, float]:
    """memory_model of this engine's model, attention kernel (attention_kind) and ZeRO-3 settings (CUDA's
    bf16 path), its states partitioned over the engine's ranks."""
    return memory_model(engine.module.config, engine.module.is_gradient_checkpointing, args.logprob_chunk, attention,
                        longest, engine.zero_max_live_parameters(), engine.world_size, engine.zero_reduce_bucket_size(),
                        getattr(args, "lora_rank", 0))


def device_fit(args, model_path: str, ds_config: dict, world: int, local_rank: int, attention: str) -> str | None:
    """CUDA, before any engine starts: whether the model's ZeRO-3 states (the KL reference's too), Adam's moments,
    an update of one longest sequence and vLLM's share fit this rank's device (device_fit_problem); the problem in
    one line."""
    from transformers import AutoConfig

    zero, longest = ds_config["zero_optimization"], args.max_prompt_len + args.max_response_len
    number = lambda key, default: v if isinstance(v := zero.get(key), (int, float)) else default  # noqa: E731
    model = memory_model(AutoConfig.from_pretrained(model_path), args.gradient_checkpointing is not False,
                         args.logprob_chunk, attention, longest,
                         number("stage3_max_live_parameters", number("max_live_parameters", 1e9)), world,
                         number("reduce_bucket_size", 5e8), args.lora_rank)
    on_host = lambda key: str((zero.get(key) or {}).get("device", "none")) != "none"  # noqa: E731
    kept = {} if on_host("offload_param") else {"bf16 weights": 2}
    if not on_host("offload_optimizer"):
        kept.update({"fp32 master weights and gradients": 8, "Adam's moments": 8})
    if args.kl_coef > 0 and not args.lora_rank and not on_host("offload_param"):  # LoRA: the base is the reference
        kept["the KL reference's bf16 weights"] = 2
    device = torch.cuda.get_device_properties(local_rank)
    return device_fit_problem(model, device.total_memory, device.name, args.vllm_gpu_memory, world, longest, kept)


def states_to_come(engine, model: dict[str, float]) -> float:
    """Bytes of Adam's moments the device has yet to hold: torch's AdamW makes them at its first step (none once
    it has stepped or a checkpoint loaded them; none on the device with optimizer offload)."""
    offload = getattr(engine.zero_offload_optimizer(), "device", "none") != "none"  # a str enum
    return 0.0 if engine.optimizer.optimizer.state or offload else model["first step"]


TRAINED_STATES = ("fp32 master weights and gradients", "Adam's moments")  # device_fit's: per trained parameter


def device_fit_problem(model: dict[str, float], total: int, device_name: str, vllm_share: float, world: int,
                       longest: int, kept: dict[str, int]) -> str | None:
    """Whether a rank of `world` fits a device of `total` bytes. It keeps, throughout, its share of the states in
    `kept` (bytes a parameter, over the ranks: 18 for bf16 weights, fp32 master weights and gradients and Adam's
    moments; less what is offloaded to the host) and the reduce bucket; beside them, in turn, vLLM's share
    (--vllm-gpu-memory: the rollout, and every wake-up takes it back) and, while vLLM sleeps, the update of one
    longest sequence and the optimizer step's transients. None if it fits, else one line saying what would."""
    update = micro_batch_bytes(model, longest)
    bucket, params, per_param = model["reduce bucket"], model["params"], sum(kept.values())
    # the weights are every parameter's; master weights, gradients and moments only the trained ones' (LoRA)
    states = sum(n * (model["trained"] if what in TRAINED_STATES else params) for what, n in kept.items())
    step = model["step"] if "Adam's moments" in kept else 0.0  # offloaded, the optimizer steps on the host
    beside = max(vllm_share * total, update, step)
    if states / world + bucket + beside <= total:
        return None
    room = total - bucket - beside
    ways = [f"use at least {math.ceil(states / room)} GPUs"] if room > 0 else []
    offloaded = (states - 16 * model["trained"]) / world + bucket + max(vllm_share * total, update)
    if "Adam's moments" in kept and offloaded <= total:
        ways.append('offload the optimizer ("offload_optimizer": {"device": "cpu"} in --ds-config\'s '
                    "zero_optimization)")
    share = (total - states / world - bucket) / total - 0.03
    if share >= 0.1 and states / world + bucket + max(update, step) <= total:
        ways.append(f"lower --vllm-gpu-memory to {share:.2f}")
    kinds = ", ".join(f"{what} {n}" for what, n in kept.items())
    lora = f"; LoRA: master weights, gradients and moments of its {model['trained'] / 1e6:.1f}M adapter " \
        "parameters only" if model["trained"] < params else ""
    return (f"{params / 1e9:.2f}B parameters keep {(states / world + bucket) / 2**30:.1f} GiB a rank on "
            f"{world} GPU(s) ({per_param} B a parameter over the ranks: {kinds}{lora}), beside the "
            f"{vllm_share * total / 2**30:.1f} GiB --vllm-gpu-memory {vllm_share} takes and the "
            f"{max(update, step) / 2**30:.1f} GiB of the update, on a {total / 2**30:.1f} GiB {device_name}: "
            + (" or ".join(ways) or "it does not fit this device") + " (docs/gpu.md)")


def memory_to_update(llm, engine, args, batching, rank: int, budget_cap: int | None = None) -> int | None:
    """CUDA, after the rollout: vLLM sleeps at level 2 (weights discarded, not copied to host: the sync
    reloads them; its KV cache freed); returns the micro-batches' token budget that the memory free then
    gives, where the run has none yet (its first step; a resumed run keeps the budget its first launch
    recorded, so --deterministic cuts the same ones), at most `cap` (one recorded on another device)."""
    llm.sleep(level=2)
    torch.cuda.empty_cache()
    if batching.micro_batch_tokens is not None:
        return None
    budget, model = measured_budget(engine, args, args.max_prompt_len + args.max_response_len)
    if rank == 0:
        print(f"[grpo] micro-batches of up to {budget} tokens (--micro-batch-tokens; "
              f"{model['per_token'] / 2**20:.2f} MiB a token, {model['fixed'] / 2**30:.1f} GiB fixed: "
              "memory_model)", flush=True)
    if budget_cap and budget_cap < budget:
        if rank == 0:
            print(f"[grpo] micro-batches of up to {budget_cap} tokens, as the run recorded them: not the {budget} "
                  "measured here", flush=True)
        return budget_cap
    return budget


def measured_budget(engine, args, longest: int) -> tuple[int, dict[str, float]]:
    """CUDA: the token budget (token_budget) for this engine's model, attention and ZeRO-3 settings on the memory
    free now less what the trainer has yet to allocate (Adam's moments, before the first optimizer step), and the
    memory_model it used."""
    model = trainer_memory(engine, args, longest, attention_kind(args, cuda=True))
    return token_budget(model, torch.cuda.mem_get_info()[0], longest, states_to_come(engine, model)), model
