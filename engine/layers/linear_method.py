"""The quantization seam of a linear layer: how it holds and applies its weight.

Every `QuantizableLinear` (layers/parallel.py) delegates to one `LinearMethod`. The layer is
built 16-bit (weight [N, K], marked with the checkpoint slices it holds, `shards`), which is
`UNQUANTIZED`; the loader picks a format's method per layer from the checkpoint's
`quantization_config` (engine/quantization/: fp8.py, int4.py) and then, in this order:

1. `create_weights(layer)`: replace the 16-bit weight by the format's parameters (FP8 values
   and a scale grid; packed INT4 values, scales and zero points).
2. `load_weights(layer, reader, parts)`: fill them from the checkpoint, `parts` being the
   checkpoint tensors' slices this rank holds (fused q/k/v and gate/up: one per part, along
   the output rows; a row-parallel layer: one slice of the input columns).
3. `after_loading(layer)`: derive what the kernels read (e.g. repack into their layout).

Then `apply` / `apply_silu_and_mul` (and, where `fuses_qkv_rope`, `apply_qkv_rope`) run the
layer. A format is one module implementing this; the 16-bit method's weight is loaded by the
loader's generic path (the layer's own parameter), so only quantized methods load their own.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from specserve.engine.layers.skinny_gemm import (
    can_fuse_qkv_rope, linear, linear_silu_and_mul, skinny_qkv_rope)


class PartSlice(NamedTuple):
    """One checkpoint tensor's piece of a layer's weight: the key of its 16-bit (or FP8)
    `weight` tensor and the slice loaded (formats storing other tensors derive their keys)."""

    key: str
    dim: int      # 0: output rows, 1: input columns
    start: int
    end: int


def read_parts(reader, parts: list[PartSlice]) -> torch.Tensor:
    """This rank's slices of the parts' tensors, concatenated along the output rows."""
    pieces = [reader.get_shard(p.key, p.dim, p.start, p.end) for p in parts]
    return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]


def method_parameter(value: torch.Tensor) -> nn.Parameter:
    """A format's parameter: frozen, and marked as loaded by its method (the loader's generic
    path skips it)."""
    param = nn.Parameter(value, requires_grad=False)
    param.loaded_by_method = True
    return param


class LinearMethod:
    """The 16-bit method (`UNQUANTIZED`): the layer's `weight` in the activation dtype, the
    skinny GEMM at decode, cuBLAS elsewhere. Formats override what differs."""

    def create_weights(self, layer: nn.Module) -> None:
        """The layer's 16-bit weight stays."""

    def load_weights(self, layer: nn.Module, reader, parts: list[PartSlice]) -> None:
        raise NotImplementedError("16-bit weights are loaded by the loader's generic path")

    def after_loading(self, layer: nn.Module) -> None:
        """Nothing to derive."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer.skinny_gemm, self.fp8_scale(layer))

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor,
                           bias: Optional[torch.Tensor]) -> torch.Tensor:
        """silu_and_mul(apply(x)) for a fused gate/up weight: one kernel where the skinny GEMM
        runs."""
        return linear_silu_and_mul(x, layer.weight, bias, layer.skinny_gemm, self.fp8_scale(layer))

    def fuses_qkv_rope(self, layer: nn.Module, x: torch.Tensor, head_dim: int,
                       qk_norm: bool) -> bool:
        """Whether `apply_qkv_rope` runs for this q/k/v layer (skinny GEMM with RoPE epilogue)."""
        return layer.skinny_gemm and can_fuse_qkv_rope(x, layer.weight, head_dim,
                                                       self.fp8_scale(layer), qk_norm)

    def apply_qkv_rope(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                       **kwargs) -> torch.Tensor:
        """`skinny_qkv_rope`'s projection, RoPE and KV store (only where `fuses_qkv_rope`)."""
        return skinny_qkv_rope(x, layer.weight, bias, scale=self.fp8_scale(layer), **kwargs)

    def fp8_scale(self, layer: nn.Module):
        """The FP8 scale grid the skinny GEMM reads beside an FP8 weight (None: 16-bit)."""
        return None


UNQUANTIZED = LinearMethod()
