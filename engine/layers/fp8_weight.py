"""The FP8 weight every kernel, the loader and the reference agree on.

A quantized linear weight W [N, K] (or a stack of experts [E, N, K]) is float8_e4m3fn values
and an fp32 scale grid: W[n, k] = float(W_fp8[n, k]) * scale[n // bn, k // bk], the grid
[ceil(N / bn), ceil(K / bk)] (the last block of a dimension may be partial). One form covers
every checkpoint format: block-wise is (128, 128); per-channel is (1, K); per-tensor is (N, K),
or (1, K) rows once fused parts with different scales sit in one weight (q/k/v).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


class WeightScale(NamedTuple):
    """The scale grid of an FP8 weight and the (rows, columns) of weight each entry covers."""

    values: torch.Tensor  # fp32 [..., ceil(N / block_n), ceil(K / block_k)]
    block_n: int
    block_k: int


def scale_grid_shape(n: int, k: int, block_n: int, block_k: int) -> tuple[int, int]:
    return -(-n // block_n), -(-k // block_k)


def expand_scale(scale: WeightScale, n: int, k: int) -> torch.Tensor:
    """The per-element scale [..., n, k] of a grid."""
    values = scale.values.repeat_interleave(scale.block_n, dim=-2)[..., :n, :]
    return values.repeat_interleave(scale.block_k, dim=-1)[..., :k]


def dequantize(weight: torch.Tensor, scale: WeightScale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the FP8 values and scales stand for, computed in fp32, then cast to `dtype`."""
    n, k = weight.shape[-2:]
    return (weight.float() * expand_scale(scale, n, k)).to(dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: WeightScale,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) with W dequantised to x's dtype: the CPU path, and what the kernels
    (which also dequantise in fp32 and round to the activation dtype) are checked against."""
    return F.linear(x, dequantize(weight, scale, x.dtype), bias)
