"""The FP8 KV cache (`EngineConfig.kv_cache_dtype="fp8_e4m3"`): storage dtype and scales.

A pool of dtype float8_e4m3fn stores `clamp(x / scale, -448, 448)` rounded to fp8 (round to
nearest even) and is read as `fp8 * scale`, with one fp32 scale per layer for K and one for V
(per tensor). Every writer of the pool quantises the same way (`quantize` here; the Triton
RoPE+store kernel and the skinny GEMM's q/k/v+RoPE epilogue reproduce it) and every reader
dequantises (the torch backend through `dequantize`; the Triton kernels fold the K scale into
the softmax scale and apply the V scale to their output).

Scales are host floats, fixed once the pool is built: kernels take them as plain arguments, so
a CUDA graph captures them and nothing is read back from the device. They come from the
checkpoint when it has them (`load_kv_scales`), else 1.0 (`resolve_kv_scales` warns).
Moving slots (`move_kv_cache`) copies the stored bytes, and the radix cache hands out slots, so
neither knows about the format.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

logger = logging.getLogger("specserve.engine")

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448: e4m3fn has no infinity, larger values saturate

# Storage dtypes of `EngineConfig.kv_cache_dtype`'s names (config.KV_CACHE_DTYPES) but "auto".
_STORAGE_DTYPES = {"fp8_e4m3": FP8_KV_DTYPE}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for `EngineConfig.kv_cache_dtype` (validated there)."""
    return model_dtype if name == "auto" else _STORAGE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


@dataclass(frozen=True)
class KVScales:
    """Per-layer, per-tensor dequantisation scales of a pool: stored value = x / scale."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self):
        if len(self.k) != len(self.v):
            raise ValueError(f"KVScales: {len(self.k)} K scales but {len(self.v)} V scales")
        for s in (*self.k, *self.v):
            if not (math.isfinite(s) and s > 0):
                raise ValueError(f"KVScales: scales must be finite and positive, got {s!r}")

    @classmethod
    def ones(cls, num_layers: int) -> "KVScales":
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.k)


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 pool stores it. Multiplying by 1/scale (not dividing) is what the Triton
    store kernels do too, so every writer stores the same bits."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def to_pool(x: torch.Tensor, pool_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a pool of `pool_dtype` stores for x: quantised for FP8, else x in that dtype."""
    return quantize(x, scale) if is_fp8(pool_dtype) else x.to(pool_dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Pool values as `dtype`: FP8 values times their scale, others converted."""
    if is_fp8(stored.dtype):
        return (stored.float() * scale).to(dtype)
    return stored.to(dtype)


class TensorSource(Protocol):
    """What `load_kv_scales` reads (engine/models/loader.py's CheckpointReader is one)."""

    def __contains__(self, key: str) -> bool: ...

    def get(self, key: str) -> torch.Tensor: ...


# Where checkpoints keep per-tensor KV scales, per layer, as (K name, V name) under
# `model.layers.{i}.self_attn.`: vLLM / ModelOpt's k_scale and v_scale, the older single
# kv_scale for both, and compressed-tensors' output scales of the k and v projections.
_SCALE_NAMES = (("k_scale", "v_scale"), ("kv_scale", "kv_scale"),
                ("k_proj.output_scale", "v_proj.output_scale"))


def _scalar(reader: TensorSource, key: str) -> float:
    t = reader.get(key)
    if t.numel() != 1:
        raise ValueError(f"kv_cache_dtype: {key} has {t.numel()} values; only per-tensor KV "
                         "scales (one value) are supported")
    return float(t.float().item())


def load_kv_scales(reader: TensorSource, num_layers: int,
                   prefix: str = "model.layers") -> Optional[KVScales]:
    """The checkpoint's KV scales of layers 0..num_layers-1, or None if it has none. A
    checkpoint with scales for some layers only is refused (the error names the first
    layer without them)."""
    k, v = [], []
    for i in range(num_layers):
        base = f"{prefix}.{i}.self_attn."
        names = next(((base + kn, base + vn) for kn, vn in _SCALE_NAMES
                      if base + kn in reader and base + vn in reader), None)
        if names is None:
            if i == 0:
                return None
            raise ValueError(f"kv_cache_dtype: the checkpoint has KV scales for layers "
                             f"0..{i - 1} but none for layer {i} (e.g. {base}k_scale)")
        k.append(_scalar(reader, names[0]))
        v.append(_scalar(reader, names[1]))
    return KVScales(tuple(k), tuple(v))


def resolve_kv_scales(reader: Optional[TensorSource], num_layers: int) -> KVScales:
    """The checkpoint's scales (reader None: random weights, no checkpoint), else 1.0 with a
    warning: values beyond +-448 then saturate."""
    scales = None if reader is None else load_kv_scales(reader, num_layers)
    if scales is None:
        logger.warning("kv_cache_dtype fp8_e4m3: the checkpoint has no KV scales "
                       "(self_attn.k_scale / v_scale); using 1.0, so K and V values beyond "
                       "+-%g saturate", FP8_MAX)
        return KVScales.ones(num_layers)
    return scales
