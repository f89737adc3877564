"""INT4 weights with 16-bit activations (W4A16): the weight form every kernel and the reference
agree on, the decode GEMM, the large-M path and the CPU reference.

The form (`Int4Weight`, made at load by quantization/int4.py from AWQ or GPTQ tensors): a
weight W [N, K] is 4-bit codes q in [0, 15] packed eight to an int32 along K, row-major
([N, K / 8]; code k at bits 4 (k % 8) of word k // 8: a weight row's K is contiguous, so the
decode kernel streams whole rows), and per group of `group_size` input columns one scale and
one zero point per output row ([N, G] each, scales in the checkpoint's float dtype, zeros
uint8): W[n, k] = (q[n, k] - zero[n, k // gs]) * scale[n, k // gs], computed in fp32 and
rounded to the activation dtype (the reference's weight, bit for bit, in every kernel).

- Decode (M <= 16 rows, CUDA): `_w4a16_kernel`, one program per (column tile, K slice): it
  loads a tile of packed words (4x fewer bytes than bf16), unpacks and dequantises it in
  registers (a K step lies inside one group: one scale and zero per row a step), and takes
  the product with x on tensor cores (rows padded to 16) or, off the dot path, with
  multiply-and-sum. The rest is the skinny GEMM's (layers/skinny_gemm.py): split-K partials
  merged in a fixed order by the last program of a tile (its workspace and arrival counters;
  deterministic, no second kernel, capturable in a CUDA graph), the bias, and for the fused
  gate/up weight the SiLU-and-mul epilogue (a program reads a gate tile and its up tile).
- Mid M (17-256 rows: large decode batches, verify steps): the same kernel over row tiles of
  64, K not split: each program still reads its weight tile once per row tile, where
  dequantising the whole weight first would write and read it again in 16 bits.
- Large M (prefill): `_dequantize_kernel` writes the weight in the activation dtype, then
  cuBLAS (a GEMM at M in the hundreds is compute-bound: the extra write and read of the
  16-bit weight is a few percent of it).
- CPU: `int4_linear_reference` (torch unpacking, then F.linear).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from specserve.engine.layers.activation import silu_and_mul
from specserve.engine.layers.skinny_gemm import (
    PARTIAL_CAPACITY, SkinnyWorkspace, _num_sms, _scratch_values, workspace_for)
from specserve.engine.pdl import launch_options, release_dependents, wait_for_predecessor

try:
    import triton
    import triton.language as tl

    from specserve.engine.layers.skinny_gemm import (
        _accumulate, _add_bias, _epilogue, _merge_splits, _pair_rows)
except ImportError:  # the CPU build needs no Triton
    triton = None

PACK = 8          # 4-bit codes per int32
MAX_ROWS = 16     # decode-sized M: one row tile, K split across programs
TILED_MAX_ROWS = 256  # M up to this: row tiles of TILE_ROWS, no split; above: dequantise + cuBLAS
TILE_ROWS = 64
STEP_CODES = 256  # the decode kernel's K step (128 bytes of a weight row); not yet tuned


class Int4Weight(NamedTuple):
    """A W4A16 weight [N, K] (see the module docstring)."""

    qweight: torch.Tensor   # int32 [N, K / 8]
    scales: torch.Tensor    # float [N, G]
    zeros: torch.Tensor     # uint8 [N, G]
    group_size: int         # input columns per group (K for one group per row)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * PACK


class W4Config(NamedTuple):
    """Launch parameters of the decode kernel."""

    block_n: int
    block_k: int     # a multiple of 8 inside one group, or spanning whole groups (`step_groups`)
    split_k: int
    num_warps: int
    num_stages: int
    dot: bool = True


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (K a multiple of 8, values 0..15) -> int32 [N, K / 8], code k at bits
    4 (k % 8) of word k // 8."""
    n, k = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (q.to(torch.int64).view(n, k // PACK, PACK) << shifts).sum(dim=-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """`pack_rows`'s inverse: int32 [N, K / 8] -> codes [N, K] (uint8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight[..., None] >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def dequantize_int4(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] the codes, scales and zeros stand for, computed in fp32, cast to dtype."""
    q = unpack_rows(w.qweight).float()
    scales = w.scales.float().repeat_interleave(w.group_size, dim=1)[:, :q.shape[1]]
    zeros = w.zeros.float().repeat_interleave(w.group_size, dim=1)[:, :q.shape[1]]
    return ((q - zeros) * scales).to(dtype)


def int4_linear_reference(x: torch.Tensor, w: Int4Weight,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x W^T (+ bias) with W dequantised to x's dtype: the CPU path and the kernels' reference."""
    return F.linear(x, dequantize_int4(w, x.dtype), bias)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None,
                skinny: bool = True) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) in x's dtype: the W4A16 kernel for up to 256 rows on CUDA
    (where `skinny` allows), the dequantise kernel and cuBLAS for more, the reference on the CPU."""
    if triton is None or not x.is_cuda:
        return int4_linear_reference(x, w, bias)
    if skinny and 1 <= x.numel() // w.shape[1] <= TILED_MAX_ROWS:
        return w4a16_gemm(x, w, bias)
    return F.linear(x, dequantize_int4_gpu(w, x.dtype), bias)


def int4_linear_silu_and_mul(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None,
                             skinny: bool = True) -> torch.Tensor:
    """silu_and_mul(int4_linear(x, w, bias)) for a fused [2I, K] gate/up weight: one kernel
    where the W4A16 kernel runs."""
    if triton is not None and x.is_cuda and skinny and 1 <= x.numel() // w.shape[1] <= TILED_MAX_ROWS:
        return w4a16_gemm(x, w, bias, silu_mul=True)
    return silu_and_mul(int4_linear(x, w, bias, skinny=False))


@functools.lru_cache(maxsize=None)
def default_w4_config(m: int, n: int, k: int, group_size: int, paired: bool = False,
                      device: torch.device = torch.device("cuda")) -> W4Config:
    """Not yet measured on a device (bench/fp8_gemm.py's w4a16 rows time it): the skinny GEMM's
    rule (32-column tiles, K split until about a program an SM, each slice at least 512 deep,
    the partials within the workspace), K steps of `STEP_CODES` codes (128 bytes a row)
    spanning whole groups of 128 or less (their scales and zeros broadcast in registers). `n`: output columns (of each half with `paired`)."""
    block_k = STEP_CODES
    tiles = -(-n // 32)
    split_k = 1
    while (m <= MAX_ROWS and tiles * split_k < _num_sms(device) and k // (2 * split_k) >= 512
           and _scratch_values(2 * split_k, m, n, paired) <= PARTIAL_CAPACITY):
        split_k *= 2
    return W4Config(block_n=32, block_k=block_k, split_k=split_k, num_warps=4,
                    num_stages=4 if split_k > 1 else 3)


def check_int4(w: Int4Weight) -> None:
    n, k = w.shape
    groups = -(-k // w.group_size)
    assert w.qweight.dtype == torch.int32 and w.qweight.is_contiguous()
    assert w.scales.shape == w.zeros.shape == (n, groups), \
        f"scales {tuple(w.scales.shape)} and zeros {tuple(w.zeros.shape)} must be [{n}, {groups}]"
    assert w.zeros.dtype == torch.uint8 and w.scales.is_contiguous() and w.zeros.is_contiguous()


def w4a16_gemm(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None,
               silu_mul: bool = False, config: Optional[W4Config] = None,
               workspace: Optional[SkinnyWorkspace] = None) -> torch.Tensor:
    """x [..., K] (at most 256 rows) @ W^T (+ bias) in x's dtype, the W4A16 kernel (more than 16
    rows: row tiles of 64, K not split); with `silu_mul`, silu_and_mul of it for a fused
    [2I, K] gate/up weight (result [..., I])."""
    n_rows, k = w.shape
    check_int4(w)
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    assert 1 <= m <= TILED_MAX_ROWS and x.shape[-1] == k
    if silu_mul:
        assert n_rows % 2 == 0, "silu_mul needs the fused [2I, K] gate/up weight"
    n_cols = n_rows // 2 if silu_mul else n_rows
    config = config or default_w4_config(m, n_cols, k, w.group_size, silu_mul, x.device)
    groups = step_groups(w.group_size, k, config.block_k)
    assert config.block_k % PACK == 0 and groups, \
        f"a K step of {config.block_k} must lie in one group of {w.group_size} or span whole ones"
    if bias is not None:
        assert bias.shape == (n_rows,) and bias.is_contiguous()
    y = torch.empty((m, n_cols), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n_cols, config.block_n)
    partials = arrivals = y  # never touched without split-K
    if config.split_k > 1:
        workspace = workspace or workspace_for(x.device)
        assert _scratch_values(config.split_k, m, n_cols, silu_mul) <= workspace.partials.numel()
        assert tiles <= workspace.arrivals.numel()
        partials, arrivals = workspace.partials, workspace.arrivals
    assert m <= MAX_ROWS or (config.split_k == 1 and config.dot), \
        "more than 16 rows: row tiles on tl.dot, K not split"
    block_m = (max(16, triton.next_power_of_2(m)) if config.dot else triton.next_power_of_2(m)) \
        if m <= MAX_ROWS else TILE_ROWS
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    _w4a16_kernel[(tiles, config.split_k, triton.cdiv(m, block_m))](
        x2, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y, partials, arrivals,
        m, n_cols, k, w.scales.shape[1], w.group_size, k_per_split, x2.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=config.split_k,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUPS=groups, DOT=config.dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x.device))
    return y.view(*x.shape[:-1], n_cols)


def step_groups(group_size: int, k: int, block_k: int) -> int:
    """The groups a K step of `block_k` reads per weight row: 1 where it lies inside one group
    (steps start at multiples of block_k), block_k / group_size where it spans whole groups (a
    power of two: a group is a reshape of the tile), else 0 (not served)."""
    if group_size >= k or group_size % block_k == 0:
        return 1
    if group_size & (group_size - 1) == 0 and block_k % group_size == 0:
        return block_k // group_size
    return 0


def dequantize_int4_gpu(w: Int4Weight, dtype: torch.dtype, block_n: int = 64,
                        block_k: int = 128) -> torch.Tensor:
    """`dequantize_int4` by one Triton kernel (the large-M path's weight)."""
    n, k = w.shape
    check_int4(w)
    out = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    groups = step_groups(w.group_size, k, block_k)
    assert groups, f"a block of {block_k} columns must lie in a group of {w.group_size} or span whole ones"
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.qweight, w.scales, w.zeros, out, n, k, w.scales.shape[1], w.group_size,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUPS=groups, num_warps=4,
        **launch_options(w.qweight.device))
    return out


if triton is not None:
    @triton.jit
    def _dequantized_tile(qweight, scales, zeros, rows, k, n_groups, group_size, K,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                          dtype: tl.constexpr):
        """W[rows, k:k + BLOCK_K] in `dtype` (columns past K are zeros): the packed words
        loaded once ([BLOCK_N, BLOCK_K / 8]), unpacked by shifts in registers, scaled with
        the rows' scale and zero of each of the GROUPS groups the step spans (`step_groups`;
        groups past K read the last one: their codes are zeros)."""
        words = k // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(qweight + rows[:, None] * (K // 8) + words[None, :],
                         mask=words[None, :] < K // 8, other=0)
        shifts = tl.arange(0, 8) * 4
        codes = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
        codes = tl.reshape(codes, (BLOCK_N, GROUPS, BLOCK_K // GROUPS)).to(tl.float32)
        group = tl.minimum(k // group_size + tl.arange(0, GROUPS), n_groups - 1)
        at = rows[:, None] * n_groups + group[None, :]
        scale = tl.load(scales + at).to(tl.float32)[:, :, None]
        zero = tl.load(zeros + at).to(tl.float32)[:, :, None]
        return tl.reshape((codes - zero) * scale, (BLOCK_N, BLOCK_K)).to(dtype)

    @triton.jit
    def _w4a16_kernel(x, qweight, scales, zeros, bias, y, partials, arrivals, M, n_cols, K,
                      n_groups, group_size, k_per_split, stride_xm, stride_ym,
                      HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUPS: tl.constexpr, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      PDL: tl.constexpr):
        # n_cols: output columns (I with SILU_MUL, whose weight has 2 * I rows).
        wait_for_predecessor(PDL)
        tile, split = tl.program_id(0), tl.program_id(1)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if SILU_MUL:
            rows, partner_rows = _pair_rows(offs_n, n_cols, n_cols)
        else:  # columns past the end read row 0: never stored
            rows = tl.where(offs_n < n_cols, offs_n, 0).to(tl.int64)
            partner_rows = rows
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # one row tile with split-K
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        dtype = x.dtype.element_ty
        if DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        for k in range(k_begin, k_end, BLOCK_K):
            x_tile = tl.load(x + offs_m[:, None] * stride_xm + k + offs_k[None, :],
                             mask=m_mask[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
            w_tile = _dequantized_tile(qweight, scales, zeros, rows, k, n_groups, group_size, K,
                                       BLOCK_N, BLOCK_K, GROUPS, dtype)
            acc = _accumulate(acc, x_tile, w_tile, DOT, DOT_PRECISION)
            if SILU_MUL:
                up_tile = _dequantized_tile(qweight, scales, zeros, partner_rows, k, n_groups,
                                            group_size, K, BLOCK_N, BLOCK_K, GROUPS, dtype)
                acc_up = _accumulate(acc_up, x_tile, up_tile, DOT, DOT_PRECISION)
        if not DOT:
            acc = tl.sum(acc, axis=2)
            acc_up = tl.sum(acc_up, axis=2)
        release_dependents(PDL)
        out_mask = m_mask[:, None] & (offs_n < n_cols)[None, :]
        last = True
        if SPLIT_K > 1:
            last, acc, acc_up = _merge_splits(acc, acc_up, partials, arrivals, tile, split, M,
                                              n_cols, offs_m, offs_n, out_mask, SILU_MUL,
                                              SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            if HAS_BIAS:
                acc, acc_up = _add_bias(acc, acc_up, bias, rows, partner_rows, SILU_MUL)
            _epilogue(acc, acc_up, y, offs_m, offs_n, out_mask, stride_ym, SILU_MUL)

    @triton.jit
    def _dequantize_kernel(qweight, scales, zeros, out, N, K, n_groups, group_size,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                           PDL: tl.constexpr):
        wait_for_predecessor(PDL)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        tile = _dequantized_tile(qweight, scales, zeros, rows, k, n_groups, group_size, K,
                                 BLOCK_N, BLOCK_K, GROUPS, out.dtype.element_ty)
        offs_k = k + tl.arange(0, BLOCK_K)
        mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        tl.store(out + rows[:, None] * K + offs_k[None, :], tile, mask=mask)
