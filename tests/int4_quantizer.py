"""Writes INT4 checkpoints (AWQ GEMM, GPTQ) from 16/32-bit ones in the layouts the published
tools write, for the tests; written from the formats' definitions, independently of the
engine's loader (quantization/int4.py), so the two check each other.

Quantization, per output row n and group of `group_size` input columns (the math of both
tools' round-to-nearest, without their calibration, which only chooses other scales):
- asymmetric (AWQ, GPTQ sym=False): s = (max - min) / 15, z = clamp(round(-min / s), 0, 15),
  q = clamp(round(w / s) + z, 0, 15);
- symmetric (GPTQ sym=True): s = amax / 7, z = 8, q = clamp(round(w / s) + 8, 0, 15).
The scales are stored fp16, and q is computed with the fp16 scale, so the dequantized weight
(q - z) * s is exactly what the checkpoint stands for.

Layouts (W the nn.Linear weight [N, K], G = K / group_size):
- AWQ (AutoAWQ WQLinear_GEMM): qweight int32 [K, N / 8]: word j of input row k holds columns
  8j .. 8j + 7, nibble i (bits 4i) holding column 8j + AWQ_ORDER[i], AWQ_ORDER =
  [0, 2, 4, 6, 1, 3, 5, 7]; qzeros int32 [G, N / 8] packed the same way; scales fp16 [G, N].
- GPTQ (AutoGPTQ QuantLinear, checkpoint_format "gptq"): qweight int32 [K / 8, N]: word i of
  column n holds input rows 8i .. 8i + 7, row 8i + j at bits 4j; qzeros int32 [G, N / 8]:
  columns in order, each stored as z - 1 (masked to 4 bits); scales fp16 [G, N];
  g_idx int32 [K] = k // group_size. "gptq_v2" (GPTQModel's): the same with qzeros = z.
`dequantized_copy` beside it: the same model with W = (q - z) * s in fp32, for transformers.
"""
from __future__ import annotations

import os

import torch
from fp8_quantizer import write_quantized
from safetensors.torch import load_file

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantizes(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in QUANTIZED and "layers." in name


def quantize_groups(w: torch.Tensor, group_size: int, sym: bool):
    """(q [N, K] int64 codes, z [N, G] int64, s [N, G] fp16) of w [N, K]."""
    n, k = w.shape
    g = k if group_size < 0 else group_size
    groups = w.float().view(n, k // g, g)
    if sym:
        s = (groups.abs().amax(dim=-1) / 7).clamp(min=1e-5).half()
        z = torch.full_like(s, 8, dtype=torch.int64)
    else:
        lo, hi = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-5).half()
        z = torch.round(-lo / s.float()).clamp(0, 15).to(torch.int64)
    q = (torch.round(groups / s.float()[..., None]) + z[..., None]).clamp(0, 15).to(torch.int64)
    return q.view(n, k), z, s


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    g = k if group_size < 0 else group_size
    return ((q.view(n, k // g, g) - z[..., None]).float() * s.float()[..., None]).view(n, k)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_columns(codes: torch.Tensor, order: list[int]) -> torch.Tensor:
    """codes [R, C] -> int32 [R, C / 8]: nibble i of word j holds column 8j + order[i]."""
    r, c = codes.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for i in range(8):
        words |= (codes[:, order[i]::8] & 0xF) << (4 * i)
    return _to_int32(words)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """codes [R, C] -> int32 [R / 8, C]: word i of column c holds rows 8i + j at bits 4j."""
    r, c = codes.shape
    words = torch.zeros(r // 8, c, dtype=torch.int64)
    for j in range(8):
        words |= (codes[j::8] & 0xF) << (4 * j)
    return _to_int32(words)


def awq_tensors(q, z, s) -> dict[str, torch.Tensor]:
    return {"qweight": pack_columns(q.t().contiguous(), AWQ_ORDER),
            "qzeros": pack_columns(z.t().contiguous(), AWQ_ORDER), "scales": s.t().contiguous()}


def gptq_tensors(q, z, s, group_size: int, v2: bool = False) -> dict[str, torch.Tensor]:
    k = q.shape[1]
    g = k if group_size < 0 else group_size
    stored = z if v2 else z - 1
    return {"qweight": pack_rows(q.t().contiguous()), "qzeros": pack_columns(stored.t().contiguous(), list(range(8))),
            "scales": s.t().contiguous(), "g_idx": (torch.arange(k) // g).to(torch.int32)}


def quant_config(fmt: str, group_size: int, sym: bool) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
            "sym": sym, "true_sequential": True, "checkpoint_format": fmt, "lm_head": False}


def quantize_checkpoint(src: str, dst: str, fmt: str, group_size: int = 32, sym: bool = False,
                        reference: str | None = None) -> str:
    """Write `src` (one safetensors file) in `fmt` ("awq", "gptq" or "gptq_v2") to `dst`; with
    `reference`, the dequantized fp32 model there."""
    assert fmt in ("awq", "gptq", "gptq_v2") and not (fmt == "awq" and sym)
    os.makedirs(dst, exist_ok=True)
    out, ref = {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if not quantizes(name):
            out[name], ref[name] = w, w.float()
            continue
        q, z, s = quantize_groups(w, group_size, sym)
        base = name[:-len("weight")]
        packed = awq_tensors(q, z, s) if fmt == "awq" else gptq_tensors(q, z, s, group_size, fmt == "gptq_v2")
        out.update({base + key: value for key, value in packed.items()})
        if fmt == "gptq":  # what the stored z - 1 means: a zero point of 0 wraps to 15 + 1
            z = ((z - 1) & 0xF) + 1
        ref[name] = dequantize(q, z, s, group_size)
    return write_quantized(src, dst, out, quant_config(fmt, group_size, sym), ref, reference)
