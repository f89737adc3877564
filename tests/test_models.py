"""Model forward parity with transformers, for every supported architecture (fp32, CPU)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import ARCHS, hf_logits, make_tiny_checkpoint



@pytest.mark.parametrize("arch,tie,sharded", [(a, False, False) for a in ARCHS]
                         + [("llama", True, False), ("qwen2", False, True)])
def test_logits_match_transformers(tmp_path, make_engine, arch, tie, sharded):
    path = make_tiny_checkpoint(str(tmp_path), arch, tie=tie, sharded=sharded, seed=3)
    if sharded:
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    ids = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = make_engine(path)
    ours = engine.prompt_logits(ids)
    ref = hf_logits(path, ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_llama3_rope_scaling_is_applied(tmp_path, make_engine):
    """Positions beyond the original context are where llama3 scaling changes the result."""
    path = make_tiny_checkpoint(str(tmp_path), "llama3", seed=4)
    engine = make_engine(path)
    assert engine.core.model_config.rope_scaling["rope_type"] == "llama3"
    ids = list(range(3, 203))
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(path, ids), atol=2e-4, rtol=1e-4)


def test_yarn_rope_scaling_is_applied(tmp_path, make_engine):
    """YaRN: interpolated low frequencies and the attention factor on cos/sin, as transformers."""
    path = make_tiny_checkpoint(str(tmp_path), "llama-yarn", seed=4)
    engine = make_engine(path)
    assert engine.core.model_config.rope_scaling["rope_type"] == "yarn"
    ids = list(range(3, 203))
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(path, ids), atol=2e-4, rtol=1e-4)


def test_unsupported_architecture_is_named(tmp_path):
    from specserve.engine import Engine, EngineConfig

    path = make_tiny_checkpoint(str(tmp_path), "llama")
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        Engine(EngineConfig(model=path, device="cpu", spec=None))


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from specserve.engine import Engine, EngineConfig

    path = make_tiny_checkpoint(str(tmp_path), "llama")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        Engine(EngineConfig(model=path, device="cpu", spec=None))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(tiny_model, make_engine, dtype):
    ids = list(range(3, 40))
    ref = make_engine(tiny_model).prompt_logits(ids)
    low = make_engine(tiny_model, dtype=dtype).prompt_logits(ids)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
