"""Loading FP8 checkpoints as published: which of our layers hold FP8 weights, the block of
their scale grid, and each scale tensor's slice for this rank.

The checkpoint decides which layers are FP8 (their `.weight` is float8_e4m3fn); the
`quantization_config` says how the scales are stored (quantization/config.py). Our layers fuse
checkpoint tensors along the output rows (q/k/v, gate/up) and tensor parallelism slices them,
so a layer keeps the checkpoint's (bn, bk) blocks only where every part starts on a block row
and every part but the last fills whole blocks; elsewhere the grid is expanded to one row per
output row (block (1, bk)), which any concatenation and any row slice keep exact. Per-channel
and per-tensor scales become that row form, (1, K). A slice of the input dimension (a
row-parallel layer's rank) must start and end on block columns: refused otherwise.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from specserve.engine.quantization.config import QuantConfig

FP8_STORAGE = "F8_E4M3"  # safetensors' name for float8_e4m3fn


class PartSlice(NamedTuple):
    """One checkpoint tensor's piece of a layer's weight: its key and the slice loaded."""

    key: str
    dim: int      # 0: output rows, 1: input columns
    start: int
    end: int


def weight_parts(param: nn.Parameter, keys: list[str]) -> list[PartSlice]:
    """The checkpoint slices a (non-expert) weight parameter is assembled from: its layer marks
    one (dim, start, end) `shards` entry per fused part (layers/parallel.py)."""
    return [PartSlice(k, *shard) for k, shard in zip(keys, param.shards)]


class Fp8Target(NamedTuple):
    """One scale grid of an FP8 layer and the checkpoint slices of the weight it scales."""

    scale_name: str                     # the layer's scale parameter
    experts: list[list[PartSlice]]      # one list of parts per expert (a linear layer: one)
    stacked: bool                       # the grid has a leading expert dimension


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


def require_quant_config(quant: Optional[QuantConfig], key: str) -> QuantConfig:
    if quant is None:
        raise ValueError(f"model: checkpoint tensor {key!r} is float8 but config.json has no "
                         f"quantization_config saying how it is scaled")
    return quant
