"""FP8 weights (W8A16): the linear layers' method and the expert stacks' parameters, as
checkpoints publish them or quantized at load (`--quantization fp8` on a 16-bit checkpoint).

The weight form (float8_e4m3fn values and an fp32 scale grid in (block_n, block_k) blocks) and
its kernels are layers/fp8_weight.py and layers/fp8_gemm.py; the skinny GEMM reads it as it is.

The checkpoint decides which layers are FP8 (their `.weight` is float8_e4m3fn); the
`quantization_config` says how the scales are stored (quantization/config.py). Our layers fuse
checkpoint tensors along the output rows (q/k/v, gate/up) and tensor parallelism slices them,
so a layer keeps the checkpoint's (bn, bk) blocks only where every part starts on a block row
and every part but the last fills whole blocks; elsewhere the grid is expanded to one row per
output row (block (1, bk)), which any concatenation and any row slice keep exact. Per-channel
and per-tensor scales become that row form, (1, K). A slice of the input dimension (a
row-parallel layer's rank) must start and end on block columns: refused otherwise.

Online (`Fp8LinearMethod.online`): the 16-bit weight is read and quantized per output row,
scale = amax(|row|) / 448 over the whole checkpoint row (so a row-parallel rank's slice gets
the scale tp=1 gets), W8 = W / scale rounded to e4m3; grid (1, K).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from specserve.engine.layers.fp8_weight import FP8_DTYPE, FP8_MAX, WeightScale, scale_grid_shape
from specserve.engine.layers.linear_method import LinearMethod, PartSlice, method_parameter, read_parts
from specserve.engine.layers.parallel import ParallelLMHead
from specserve.engine.quantization.config import QuantConfig

FP8_STORAGE = "F8_E4M3"  # safetensors' name for float8_e4m3fn
LOADER_MARKS = ("shards", "stacked_experts")


class Fp8LinearMethod(LinearMethod):
    """An FP8 linear layer: `weight` float8_e4m3fn [N, K] and `weight_scale` its fp32 grid in
    (block_n, block_k) blocks; the kernels dequantise tiles in registers (W8A16)."""

    def __init__(self, block: tuple[int, int], quant: Optional[QuantConfig] = None):
        self.block = block
        self.quant = quant  # None: quantize the 16-bit checkpoint weight at load (online)

    def create_weights(self, layer: nn.Module) -> None:
        layer.weight = fp8_parameter(layer.weight)
        layer.weight.loaded_by_method = True
        layer.weight_scale = scale_parameter(layer.weight, *self.block)

    def load_weights(self, layer: nn.Module, reader, parts: list[PartSlice]) -> None:
        if self.quant is None:
            weight, grid = quantize_rows_online(reader, parts)
        else:
            weight, grid = read_parts(reader, parts), load_scale(reader, parts, self.quant, self.block)
        what = parts[0].key.removesuffix(".weight")
        for target, value, name in ((layer.weight, weight, "weight"), (layer.weight_scale, grid, "scales")):
            # A vocabulary shard's padding rows (the last rank's LM head) stay zero.
            padded = isinstance(layer, ParallelLMHead) and value.shape[0] <= target.shape[0]
            if value.shape[1:] != target.shape[1:] or (value.shape[0] != target.shape[0] and not padded):
                raise ValueError(f"model: {what}: checkpoint {name} give shape {tuple(value.shape)}, "
                                 f"expected {tuple(target.shape)}")
            with torch.no_grad():
                target.zero_()
                target[:value.shape[0]].copy_(value)

    def fp8_scale(self, layer: nn.Module) -> WeightScale:
        return weight_scale(layer.weight_scale)


def fp8_method_for(quant: Optional[QuantConfig], reader, parts: list[PartSlice], what: str
                   ) -> Optional[Fp8LinearMethod]:
    """The FP8 method of a linear layer whose checkpoint weights are float8 (None: they are
    not); all or none of a fused layer's parts must be."""
    fp8 = [is_fp8(reader, p.key) for p in parts]
    if not any(fp8):
        return None
    if not all(fp8):
        raise ValueError(f"model: {what}: some checkpoint tensors are float8 and some not "
                         f"({[p.key for p in parts]}); one layer needs one format")
    quant = require_quant_config(quant, parts[0].key)
    return Fp8LinearMethod(scale_block(parts, reader, quant, what), quant)


def online_fp8_method(layer: nn.Module) -> Fp8LinearMethod:
    """Per-channel FP8 for a 16-bit layer quantized at load: one scale row per output row."""
    return Fp8LinearMethod((1, layer.weight.shape[1]))


def quantize_rows_online(reader, parts: list[PartSlice]) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8 [N, K], scales [N, 1]) of this rank's slices, each row scaled by its whole
    checkpoint row's amax / 448."""
    weights, scales = [], []
    for part in parts:
        rows = (part.start, part.end) if part.dim == 0 else (0, reader.shape(part.key)[0])
        full = reader.get_shard(part.key, 0, *rows).float()  # every column of the rows held
        scale = (full.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        w8 = (full / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        weights.append(w8[:, part.start:part.end] if part.dim == 1 else w8)
        scales.append(scale)
    return torch.cat(weights), torch.cat(scales)


# --- parameters -------------------------------------------------------------------------
def fp8_parameter(param: nn.Parameter) -> nn.Parameter:
    """An empty float8_e4m3fn parameter of `param`'s shape and device, with its loader marks."""
    out = nn.Parameter(torch.empty(param.shape, dtype=FP8_DTYPE, device=param.device),
                       requires_grad=False)
    for mark in LOADER_MARKS:
        if hasattr(param, mark):
            setattr(out, mark, getattr(param, mark))
    return out


def scale_parameter(weight: nn.Parameter, block_n: int, block_k: int) -> nn.Parameter:
    """The fp32 scale grid of `weight` ([..., N, K]) in blocks of (block_n, block_k), loaded
    by the FP8 method (experts: by the loader's expert path), not the generic one."""
    *lead, n, k = weight.shape
    out = method_parameter(torch.ones((*lead, *scale_grid_shape(n, k, block_n, block_k)),
                                      dtype=torch.float32, device=weight.device))
    out.scale_block = (block_n, block_k)
    return out


def weight_scale(scale: nn.Parameter | None) -> WeightScale | None:
    """The kernels' view of a scale parameter (None for a 16-bit weight)."""
    return None if scale is None else WeightScale(scale, *scale.scale_block)


# --- checkpoint scales ------------------------------------------------------------------
class Fp8Target(NamedTuple):
    """One scale grid of an FP8 expert stack and the checkpoint slices of the weight it scales."""

    scale_name: str                     # the stack's scale parameter
    experts: list[list[PartSlice]]      # one list of parts per expert


def is_fp8(reader, key: str) -> bool:
    return reader.dtype(key) == FP8_STORAGE


def scale_block(parts: list[PartSlice], reader, quant: QuantConfig, what: str) -> tuple[int, int]:
    """The (block_n, block_k) of the layer's scale grid (see the module docstring)."""
    rows, cols = reader.shape(parts[0].key)
    if quant.granularity != "block":
        k = parts[0].end - parts[0].start if parts[0].dim == 1 else cols
        return 1, k
    bn, bk = quant.weight_block
    aligned = True
    for i, part in enumerate(parts):
        total = reader.shape(part.key)[part.dim]
        if part.dim == 1:
            if part.start % bk or (part.end % bk and part.end != total):
                raise ValueError(f"model: {what}: this rank's input columns [{part.start}, {part.end}) "
                                 f"of {part.key!r} cut a {bn}x{bk} FP8 scale block; choose a tp_size "
                                 f"that splits it on multiples of {bk}")
            continue
        last = i == len(parts) - 1
        aligned &= part.start % bn == 0 and (last or (part.end - part.start) % bn == 0)
    return (bn, bk) if aligned else (1, bk)


def load_scale(reader, parts: list[PartSlice], quant: QuantConfig, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 scale grid of a layer assembled from its parts' scale tensors."""
    pieces = []
    for part in parts:
        key = scale_key(part.key, quant)
        if key not in reader:
            raise ValueError(f"model: checkpoint is missing tensor {key!r} (the scales of the FP8 "
                             f"weight {part.key!r}, as quantization_config's format stores them)")
        scale = reader.get(key).float()
        rows, cols = reader.shape(part.key)
        pieces.append(_part_scale(scale, part, rows, cols, quant, block))
    return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]


def scale_key(weight_key: str, quant: QuantConfig) -> str:
    return weight_key.removesuffix("weight") + quant.scale_name


def _part_scale(scale: torch.Tensor, part: PartSlice, rows: int, cols: int, quant: QuantConfig,
                block: tuple[int, int]) -> torch.Tensor:
    row_range = (part.start, part.end) if part.dim == 0 else (0, rows)
    if quant.granularity != "block":  # one value per row (channel) or per tensor
        per_row = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1).expand(rows, 1)
        if per_row.shape[0] != rows:
            raise ValueError(f"model: {part.key!r}: scale of shape {tuple(scale.shape)} fits neither "
                             f"per-tensor nor per-channel for {rows} rows")
        return per_row[row_range[0]:row_range[1]].contiguous()
    qbn, qbk = quant.weight_block
    expected = (-(-rows // qbn), -(-cols // qbk))
    if tuple(scale.shape) != expected:
        raise ValueError(f"model: {scale_key(part.key, quant)!r} has shape {tuple(scale.shape)}, "
                         f"expected {expected} for {qbn}x{qbk} blocks of a {rows}x{cols} weight")
    if part.dim == 1:  # input columns sliced on block boundaries (scale_block checked)
        scale = scale[:, part.start // qbk:-(-part.end // qbk)]
    if block[0] == 1:  # one row of scales per output row
        return scale.repeat_interleave(qbn, dim=0)[row_range[0]:row_range[1]].contiguous()
    return scale[row_range[0] // qbn:-(-row_range[1] // qbn)].contiguous()


def require_quant_config(quant, key: str) -> QuantConfig:
    """The FP8 format of a checkpoint with float8 tensors; refused without one."""
    if quant is None or getattr(quant, "online", False):
        raise ValueError(f"model: checkpoint tensor {key!r} is float8 but config.json has no "
                         f"quantization_config saying how it is scaled")
    if not isinstance(quant, QuantConfig):
        raise ValueError(f"model: checkpoint tensor {key!r} is float8 but quantization_config "
                         f"is {quant.name}")
    return quant
