"""ModelConfig: the parts of a Hugging Face config.json that our forwards need (the Llama family,
DeepSeek-V2/V3 with their MLA and MoE settings, and the Llama-attention MoE families Qwen3-MoE
and Mixtral)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from specserve.engine.quantization.config import QuantConfig, parse_quantization_config

# Architecture name -> (qkv bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "DeepseekV2ForCausalLM": (False, False),
    "DeepseekV3ForCausalLM": (False, False),
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
}
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: K/V are one compressed latent plus a shared RoPE key."""

    q_lora_rank: Optional[int]   # None: q is one projection of the hidden state
    kv_lora_rank: int            # latent width (what the KV pool stores, with the rope key)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool        # the checkpoint's rope dims are (x0, x1), (x2, x3), ... pairs

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts: which layers, how tokens pick experts, shared experts. DeepSeek's layers
    [0, first_k_dense_replace) are dense; Qwen3-MoE's are dense where listed in mlp_only_layers
    or where (layer + 1) is not a multiple of sparse_step; Mixtral's are all MoE."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int   # layers [0, k) keep a dense MLP, the rest are MoE
    scoring: str                 # "softmax" (V2) or "sigmoid" (V3, with the correction bias)
    num_groups: int              # group-limited routing: experts in num_groups groups,
    topk_groups: int             # tokens pick among the best topk_groups of them
    norm_topk_prob: bool
    routed_scaling_factor: float
    has_correction_bias: bool    # V3: e_score_correction_bias steers the choice, not the weight
    sparse_step: int = 1         # Qwen3-MoE's decoder_sparse_step
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return (layer >= self.first_k_dense_replace and layer not in self.mlp_only_layers
                and (layer + 1) % self.sparse_step == 0)


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
    mla: Optional[MLAConfig] = None
    moe: Optional[MoEConfig] = None
    quantization: Optional[QuantConfig] = None  # how quantized weights are stored (None: 16-bit)

    @staticmethod
    def from_dict(cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"model: unsupported architecture {archs!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        quantization = parse_quantization_config(cfg.get("quantization_config"))
        mla = moe = None
        if arch in DEEPSEEK_ARCHITECTURES:
            mla, moe = _deepseek_parts(arch, cfg)
        elif arch == "Qwen3MoeForCausalLM":
            moe = _qwen3_moe_parts(cfg)
        elif arch == "MixtralForCausalLM":
            moe = _mixtral_parts(cfg)
        qkv_bias = qkv_bias or bool(cfg.get("attention_bias", False))
        num_heads = cfg["num_attention_heads"]
        # DeepSeek configs carry head_dim = the rope dims; an MLA head's q/k width is nope + rope.
        head_dim = mla.qk_head_dim if mla is not None else \
            cfg.get("head_dim") or cfg["hidden_size"] // num_heads
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
            rope_scaling=None if rope_type == "default" else _scaling(rope, rope_type, cfg),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            mla=mla,
            moe=moe,
            quantization=quantization,
        )

    @staticmethod
    def from_dir(path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            return ModelConfig.from_dict(json.load(f))


def _scaling(rope: dict, rope_type: str, cfg: dict) -> dict:
    out = dict(rope, rope_type=rope_type)
    if rope_type == "yarn":  # transformers' defaults: factor from the context ratio, old length
        out.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
        if out.get("factor") is None:
            out["factor"] = cfg.get("max_position_embeddings", 2048) / out["original_max_position_embeddings"]
    return out


def _deepseek_parts(arch: str, cfg: dict) -> tuple[MLAConfig, Optional[MoEConfig]]:
    v3 = arch == "DeepseekV3ForCausalLM"
    _require_silu_without(arch, cfg, ("attention_bias", "mlp_bias"))
    mla = MLAConfig(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        # V2 always rotates interleaved pairs; V3 says so (transformers' default: True).
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True)
    num_experts = cfg.get("n_routed_experts")
    if not num_experts:
        return mla, None
    scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"model: scoring_func {scoring!r} is not supported for {arch}")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    grouped = v3 or method == "group_limited_greedy"
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        num_shared_experts=cfg.get("n_shared_experts") or 0,
        first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
        scoring=scoring,
        num_groups=(cfg.get("n_group") or 1) if grouped else 1,
        topk_groups=(cfg.get("topk_group") or 1) if grouped else 1,
        # As transformers (and the released V2 checkpoints, which set it False): V2 never
        # renormalises the top-k weights.
        norm_topk_prob=v3 and bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        has_correction_bias=v3)
    if moe.num_experts % moe.num_groups or moe.topk_groups > moe.num_groups:
        raise ValueError(f"model: n_group {moe.num_groups} / topk_group {moe.topk_groups} do not "
                         f"fit n_routed_experts {moe.num_experts}")
    return mla, moe


def _require_silu_without(arch: str, cfg: dict, biases: tuple[str, ...]) -> None:
    """Refuse, by name, the bias flags set in `biases` and an activation other than SiLU."""
    for flag in biases:
        if cfg.get(flag):
            raise ValueError(f"model: {flag}=true is not supported for {arch}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: hidden_act {cfg['hidden_act']!r} is not supported for {arch} (silu is)")


def _softmax_topk(num_experts: int, top_k: int, moe_intermediate_size: int, norm_topk_prob: bool,
                  sparse_step: int = 1, mlp_only_layers: tuple[int, ...] = ()) -> MoEConfig:
    """Qwen3-MoE's and Mixtral's routing: softmax over every expert's logit, the top k of those
    probabilities, renormalised over the k when norm_topk_prob (always for Mixtral)."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"model: num_experts_per_tok {top_k} does not fit {num_experts} experts")
    return MoEConfig(num_experts=num_experts, top_k=top_k, moe_intermediate_size=moe_intermediate_size,
                     num_shared_experts=0, first_k_dense_replace=0, scoring="softmax", num_groups=1,
                     topk_groups=1, norm_topk_prob=norm_topk_prob, routed_scaling_factor=1.0,
                     has_correction_bias=False, sparse_step=sparse_step, mlp_only_layers=mlp_only_layers)


def _qwen3_moe_parts(cfg: dict) -> Optional[MoEConfig]:
    arch = "Qwen3MoeForCausalLM"
    # attention_bias: transformers gives o_proj a bias too then, which our attention lacks.
    _require_silu_without(arch, cfg, ("attention_bias", "mlp_bias"))
    # Qwen2-MoE's shared expert (and its sigmoid gate) is not part of Qwen3-MoE: a config that
    # asks for one is some other model under this name.
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(f"model: shared_expert_intermediate_size (a shared expert) is not supported "
                         f"for {arch}")
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 saves the latter
    if not num_experts:
        return None  # every layer dense (transformers' num_experts == 0)
    step = cfg.get("decoder_sparse_step") or 1
    return _softmax_topk(num_experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                         bool(cfg.get("norm_topk_prob", False)), sparse_step=step,
                         mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))


def _mixtral_parts(cfg: dict) -> MoEConfig:
    arch = "MixtralForCausalLM"
    _require_silu_without(arch, cfg, ("mlp_bias",))
    # Every layer is MoE, and each expert is intermediate_size wide (Mixtral has no dense MLP).
    return _softmax_topk(cfg.get("num_local_experts") or cfg["num_experts"], cfg["num_experts_per_tok"],
                         cfg["intermediate_size"], norm_topk_prob=True)
