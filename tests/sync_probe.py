"""Greedy log-probs of a long prompt from vLLM after an in-place weight load, vs a fresh engine.

Run by tests/test_weight_sync.py in its own process (vLLM changes process-wide torch settings).
    python tests/sync_probe.py DEMO_MODEL_DIR WORK_DIR
"""

import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import train_grpo  # noqa: E402  (sets the in-process engine environment before vllm loads)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    src, work = sys.argv[1], Path(sys.argv[2])
    dst = work / "perturbed"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("eval"))
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in load_file(f"{src}/model.safetensors").items()}
    save_file(new, dst / "model.safetensors", metadata={"format": "pt"})
    prompt = TokensPrompt(prompt_token_ids=[5 + i % 300 for i in range(400)])  # several full KV blocks
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    logprobs = lambda out: [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]  # noqa: E731
    kw = dict(dtype="float32", enforce_eager=True, max_model_len=512)
    fresh = LLM(model=str(dst), **kw)
    want = logprobs(fresh.generate([prompt], sp, use_tqdm=False)[0])
    del fresh
    llm = LLM(model=src, **kw)
    before = logprobs(llm.generate([prompt], sp, use_tqdm=False)[0])  # fills the prefix cache
    train_grpo.load_weights_into_vllm(llm, weights_iterator=iter(new.items()))
    after = logprobs(llm.generate([prompt], sp, use_tqdm=False)[0])
    print(json.dumps({"want": want, "before": before, "after": after}))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    main()
    train_grpo.exit_without_teardown()
