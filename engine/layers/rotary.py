"""Rotary position embedding (neox layout) with the default, llama3 and YaRN frequency schedules."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from specserve.engine.layers.fused_loader import fused


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r} (default, llama3 and yarn are)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """YaRN scales cos and sin by this (1 for the other schedules), as transformers does."""
    s = scaling or {}
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"], s["mscale_all_dim"])
    return yarn_mscale(s["factor"])


def _yarn_inv_freq(dim: int, base: float, s: dict) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, and ramp
    linearly between the dims that rotate beta_slow and beta_fast times over the original context."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k at the given positions from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: Optional[dict]):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]."""
        if q.is_cuda and fused is not None:
            return fused.rope(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    @property
    def stores_kv(self) -> bool:
        """Whether `rotate_and_store_kv` is one fused kernel here (CUDA with triton)."""
        return self.cos.is_cuda and fused is not None

    def rotate_and_store_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            loc: torch.Tensor, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
        """RoPE of q and k, with k and v written to the caches' rows `loc` (quantised with
        `k_scale`, `v_scale` when the caches are FP8); returns q.
        One kernel instead of RoPE plus two indexed copies (only where `stores_kv`)."""
        return fused.rope_and_store_kv(positions, q, k, v, self.cos, self.sin, k_cache, v_cache,
                                       loc, k_scale, v_scale)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
