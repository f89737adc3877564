"""ModelConfig: the parts of a Hugging Face config.json that the Llama-family forward needs."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

# Architecture name -> (qkv bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: Optional[str]
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def from_dict(cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"model: unsupported architecture {archs!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        qkv_bias = qkv_bias or bool(cfg.get("attention_bias", False))
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers >= 5 nests RoPE settings under rope_parameters; older files keep them flat.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        max_pos = cfg.get("max_position_embeddings", 2048)
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) \
                and cfg["sliding_window"] < max_pos:
            # Exact without a windowed kernel: never let a sequence grow past the window.
            max_pos = cfg["sliding_window"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @staticmethod
    def from_dir(path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            return ModelConfig.from_dict(json.load(f))
