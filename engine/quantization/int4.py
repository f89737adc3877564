"""INT4 checkpoints (AWQ, GPTQ): the linear layers' W4A16 method.

On disk, per quantized layer `<m>` (W the nn.Linear weight [N, K], G = K / group_size groups):
- AWQ (AutoAWQ, GEMM version): `<m>.qweight` int32 [K, N / 8], eight output columns a word
  in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i, bits 4i, holds column
  8j + AWQ_ORDER[i]); `<m>.qzeros` int32 [G, N / 8] packed the same way; `<m>.scales` fp16
  [G, N]. W[n, k] = (q[k, n] - z[g, n]) * s[g, n].
- GPTQ: `<m>.qweight` int32 [K / 8, N], eight input rows a word in order (row 8i + j at bits
  4j); `<m>.qzeros` int32 [G, N / 8], eight columns a word in order, each stored as z - 1
  (`checkpoint_format` "gptq"; "gptq_v2" stores z); `<m>.scales` fp16 [G, N]; `<m>.g_idx`
  int32 [K] = k // group_size (desc_act false; anything else is refused).

Both become the kernels' form (layers/int4_gemm.py: codes packed along K per output row,
interleaved in the blocks its decode kernel reads (`interleave_for`), scales and zeros
[N, G]) at load: each part is unpacked, sliced to this rank's rows or columns, fused along
the output rows and packed again. A row-parallel slice of K must fall on
group boundaries (refused otherwise, naming tp_size). MoE experts and MLA are not served in
INT4 (refused by name).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from specserve.engine.layers.int4_gemm import (
    PACK, Int4Weight, int4_linear, int4_linear_silu_and_mul, interleave_for, pack_rows)
from specserve.engine.layers.linear_method import LinearMethod, PartSlice, method_parameter
from specserve.engine.quantization.config import Int4Config

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble i holds column AWQ_ORDER[i] of its eight
AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(c) for c in range(PACK))  # column c is nibble [c]
QUANTIZED_TENSORS = ("qweight", "qzeros", "scales")


class Int4LinearMethod(LinearMethod):
    """An INT4 linear layer: `qweight` int32 [N, K / 8], `scales` [N, G], `zeros` uint8 [N, G]
    (layers/int4_gemm.py's form); the decode kernel has the SiLU-and-mul epilogue, not the
    RoPE one (q/k/v: the GEMM, then the RoPE kernel)."""

    def __init__(self, config: Int4Config):
        self.config = config

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.weight.shape
        if k % PACK:
            raise ValueError(f"model: an INT4 layer's input features ({k}) must be a multiple of {PACK}")
        group = k if self.config.group_size < 0 else self.config.group_size
        groups = -(-k // group)
        device = layer.weight.device
        del layer.weight
        layer.qweight = method_parameter(torch.zeros(n, k // PACK, dtype=torch.int32, device=device))
        # (the checkpoint's dtype replaces fp16 at load)
        layer.scales = method_parameter(torch.zeros(n, groups, dtype=torch.float16, device=device))
        layer.zeros = method_parameter(torch.zeros(n, groups, dtype=torch.uint8, device=device))
        layer.group_size = group
        layer.interleave = interleave_for(n, k, group)

    def load_weights(self, layer: nn.Module, reader, parts: list[PartSlice]) -> None:
        codes, scales, zeros = [], [], []
        for part in parts:
            q, s, z = self._unpack_part(reader, part)
            codes.append(q)
            scales.append(s)
            zeros.append(z)
        n, k8 = layer.qweight.shape
        q = torch.cat(codes)
        if q.shape != (n, k8 * PACK):
            raise ValueError(f"model: {parts[0].key.removesuffix('.weight')}: INT4 tensors give a "
                             f"weight of shape {tuple(q.shape)}, expected {(n, k8 * PACK)}")
        with torch.no_grad():
            layer.qweight.copy_(pack_rows(q, layer.interleave))
            layer.scales.data = torch.cat(scales).to(layer.qweight.device).contiguous()
            layer.zeros.copy_(torch.cat(zeros))

    def _unpack_part(self, reader, part: PartSlice):
        """This rank's codes [rows, cols] (W's orientation), scales and zeros [rows, groups]."""
        base = part.key.removesuffix("weight")
        missing = [base + t for t in QUANTIZED_TENSORS if base + t not in reader]
        if missing:
            raise ValueError(f"model: checkpoint is missing tensor {missing[0]!r} "
                             f"({self.config.method} stores qweight, qzeros and scales a layer)")
        qweight, qzeros, scales = (reader.get(base + t) for t in QUANTIZED_TENSORS)
        if self.config.method == "awq":
            q = _unpack_columns(qweight, AWQ_COLUMN_NIBBLE)            # [K, N]
        else:
            self._check_g_idx(reader, base, qweight.shape[0] * PACK)
            q = _unpack_rows_of_words(qweight)                         # [K, N]
        z = _unpack_columns(qzeros, AWQ_COLUMN_NIBBLE if self.config.method == "awq" else tuple(range(PACK)))
        z = z + self.config.zero_offset  # 0..16: uint8 below
        k_total, n_total = q.shape
        group = k_total if self.config.group_size < 0 else self.config.group_size
        groups = -(-k_total // group)
        if scales.shape != (groups, n_total) or z.shape != (groups, n_total):
            raise ValueError(f"model: {base}scales {tuple(scales.shape)} / qzeros gives "
                             f"{tuple(z.shape)}: expected [{groups}, {n_total}] for group_size "
                             f"{self.config.group_size} of a {n_total}x{k_total} weight")
        if part.dim == 0:
            q, scales, z = q[:, part.start:part.end], scales[:, part.start:part.end], z[:, part.start:part.end]
        elif self.config.group_size > 0:
            if part.start % group or (part.end % group and part.end != k_total):
                raise ValueError(f"model: {base.rstrip('.')}: this rank's input columns "
                                 f"[{part.start}, {part.end}) cut an INT4 group of {group}; choose a "
                                 f"tp_size that splits it on multiples of {group}")
            q = q[part.start:part.end]
            scales, z = scales[part.start // group:-(-part.end // group)], z[part.start // group:-(-part.end // group)]
        else:  # one group over all of K: every slice keeps it
            q = q[part.start:part.end]
        return q.t().contiguous(), scales.t().contiguous(), z.t().to(torch.uint8).contiguous()

    def _check_g_idx(self, reader, base: str, k: int) -> None:
        """GPTQ without act-order stores g_idx = k // group_size (or none): anything else is an
        act-order checkpoint whose config says otherwise, refused rather than misread."""
        if base + "g_idx" not in reader or self.config.group_size < 0:
            return
        g_idx = reader.get(base + "g_idx")
        expected = torch.arange(k, dtype=g_idx.dtype) // self.config.group_size
        if not torch.equal(g_idx, expected):
            raise ValueError(f"model: {base}g_idx is not k // group_size (an act-order "
                             f"checkpoint); quantization_config desc_act true is not supported")

    def weight(self, layer: nn.Module) -> Int4Weight:
        return Int4Weight(layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.interleave)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return int4_linear(x, self.weight(layer), bias, layer.skinny_gemm)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor,
                           bias: Optional[torch.Tensor]) -> torch.Tensor:
        return int4_linear_silu_and_mul(x, self.weight(layer), bias, layer.skinny_gemm)

    def fuses_qkv_rope(self, layer: nn.Module, x: torch.Tensor, head_dim: int, qk_norm: bool) -> bool:
        return False


def int4_method_for(config: Int4Config, reader, parts: list[PartSlice], what: str
                    ) -> Optional[Int4LinearMethod]:
    """The INT4 method of a linear layer whose checkpoint parts are INT4 (None: they are stored
    16-bit, e.g. `modules_to_not_convert`); all or none of a fused layer's parts must be."""
    quantized = [p.key.removesuffix("weight") + "qweight" in reader for p in parts]
    if not any(quantized):
        return None
    if not all(quantized):
        raise ValueError(f"model: {what}: some checkpoint parts are INT4 and some not "
                         f"({[p.key for p in parts]}); one layer needs one format")
    return Int4LinearMethod(config)


def _unpack_columns(packed: torch.Tensor, column_nibble: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C / 8] with eight columns a word (column c of a word at nibble
    column_nibble[c]) -> codes [R, C] (int16)."""
    shifts = torch.tensor([4 * column_nibble[c] for c in range(PACK)], dtype=torch.int32)
    return ((packed[..., None] >> shifts) & 0xF).to(torch.int16).flatten(-2)


def _unpack_rows_of_words(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight int32 [K / 8, N] (row 8i + j at bits 4j of word i) -> codes [K, N]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [K / 8, 8, N]
    return codes.to(torch.int16).flatten(0, 1)
