"""vLLM after an in-place weight load computes exactly what a fresh engine on those weights does."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def untied_copy(model: Path, dest: Path) -> Path:
    """The demo policy with its own lm_head (tie_word_embeddings false), as Qwen2.5-7B has."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest, ignore=shutil.ignore_patterns("eval"))
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    weights = load_file(dest / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embed + 0.02 * torch.randn(embed.shape, generator=torch.Generator().manual_seed(1))
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_in_place_load_matches_fresh_engine_on_a_cached_long_prompt(head, demo_dir, tmp_path):
    model = demo_dir / "model" if head == "tied" else untied_copy(demo_dir / "model", tmp_path / "untied")
    res = subprocess.run([sys.executable, "tests/sync_probe.py", str(model), str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["before"] != pytest.approx(out["want"], abs=1e-4)  # the new weights do change the output
    # neither the stale prefix cache nor a stale packed lm_head (tied or its own) may survive the load
    assert out["after"] == pytest.approx(out["want"], abs=1e-5)
