"""Turning a layer's 16-bit weight parameter into an FP8 one with its scale grid
(quantization/fp8.py's form), before the loader fills both.

The FP8 parameter keeps the loader's marks (`shards`, `stacked_experts`); the scale parameter
records which weight it scales and its block, so the loader reads the checkpoint's scale
tensor for it."""
from __future__ import annotations

import torch
from torch import nn

from specserve.engine.quantization.fp8 import FP8_DTYPE, WeightScale, scale_grid_shape

LOADER_MARKS = ("shards", "stacked_experts")


def fp8_parameter(param: nn.Parameter) -> nn.Parameter:
    """An empty float8_e4m3fn parameter of `param`'s shape and device, with its loader marks."""
    out = nn.Parameter(torch.empty(param.shape, dtype=FP8_DTYPE, device=param.device),
                       requires_grad=False)
    for mark in LOADER_MARKS:
        if hasattr(param, mark):
            setattr(out, mark, getattr(param, mark))
    return out


def scale_parameter(weight: nn.Parameter, block_n: int, block_k: int) -> nn.Parameter:
    """The fp32 scale grid of `weight` ([..., N, K]) in blocks of (block_n, block_k)."""
    *lead, n, k = weight.shape
    out = nn.Parameter(torch.ones((*lead, *scale_grid_shape(n, k, block_n, block_k)),
                                  dtype=torch.float32, device=weight.device), requires_grad=False)
    out.scale_block = (block_n, block_k)
    return out


def weight_scale(scale: nn.Parameter | None) -> WeightScale | None:
    """The kernels' view of a scale parameter (None for a 16-bit weight)."""
    return None if scale is None else WeightScale(scale, *scale.scale_block)
