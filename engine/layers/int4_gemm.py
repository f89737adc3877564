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
  multiply-and-sum. Split-K programs store fp32 partials that one sum adds in a fixed order
  (deterministic; no host work: capturable in a CUDA graph).
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

from specserve.engine.pdl import launch_options, wait_for_predecessor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build needs no Triton
    triton = None

PACK = 8          # 4-bit codes per int32
MAX_ROWS = 16     # M above this dequantises and runs cuBLAS


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
    block_k: int     # a multiple of 8 dividing the group size (a step in one group)
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
    """x [..., K] @ W^T (+ bias) in x's dtype: the decode kernel for up to 16 rows on CUDA
    (where `skinny` allows), the dequantise kernel and cuBLAS for more, the reference on the CPU."""
    if triton is None or not x.is_cuda:
        return int4_linear_reference(x, w, bias)
    m = x.numel() // w.shape[1]
    if skinny and 1 <= m <= MAX_ROWS:
        return w4a16_gemm(x, w, bias)
    return F.linear(x, dequantize_int4_gpu(w, x.dtype), bias)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: an H100's count, so CPU tests see the GPU's configs


@functools.lru_cache(maxsize=None)
def default_w4_config(m: int, n: int, k: int, group_size: int,
                      device: torch.device = torch.device("cuda")) -> W4Config:
    """Not yet measured on a device (bench/fp8_gemm.py --int4 times it): the skinny GEMM's rule
    (32-column tiles, K split until about a program an SM, each slice at least 512 deep), K
    steps of 128 codes (64 bytes a row) cut to the group size."""
    block_k = min(128, group_size if group_size > 0 else 128)
    tiles = -(-n // 32)
    split_k = 1
    while tiles * split_k < _num_sms(device) and k // (2 * split_k) >= 512:
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
               config: Optional[W4Config] = None) -> torch.Tensor:
    """x [..., K] (at most 16 rows) @ W^T (+ bias) in x's dtype, the decode kernel."""
    n, k = w.shape
    check_int4(w)
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    assert 1 <= m <= MAX_ROWS and x.shape[-1] == k
    config = config or default_w4_config(m, n, k, w.group_size, x.device)
    assert config.block_k % PACK == 0 and (w.group_size >= k or w.group_size % config.block_k == 0), \
        f"a K step of {config.block_k} must lie in one group of {w.group_size}"
    if bias is not None:
        assert bias.shape == (n,)
    split = config.split_k
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    grid = (triton.cdiv(n, config.block_n), split)
    _w4a16_kernel[grid](
        x2, w.qweight, w.scales, w.zeros, bias if bias is not None and split == 1 else x2, out,
        m, n, k, w.scales.shape[1], w.group_size, k_per_split, x2.stride(0),
        HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=max(16, triton.next_power_of_2(m)) if config.dot else triton.next_power_of_2(m),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT=config.dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x.device))
    if split > 1:  # the partials' sum in split order (deterministic), bias in fp32, one rounding
        y = out.sum(dim=0)
        if bias is not None:
            y += bias.float()
        out = y.to(x.dtype)
    return out.view(*x.shape[:-1], n)


def dequantize_int4_gpu(w: Int4Weight, dtype: torch.dtype, block_n: int = 64,
                        block_k: int = 128) -> torch.Tensor:
    """`dequantize_int4` by one Triton kernel (the large-M path's weight)."""
    n, k = w.shape
    check_int4(w)
    out = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    block_k = min(block_k, w.group_size) if w.group_size < k else block_k
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.qweight, w.scales, w.zeros, out, n, k, w.scales.shape[1], w.group_size,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **launch_options(w.qweight.device))
    return out


if triton is not None:
    @triton.jit
    def _dequantized_tile(qweight, scales, zeros, rows, k, n_groups, group_size, K,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
        """W[rows, k:k + BLOCK_K] in `dtype` (columns past K are zeros): the packed words
        loaded once ([BLOCK_N, BLOCK_K / 8]), unpacked by shifts in registers, scaled with
        the rows' one scale and zero of the step's group."""
        words = k // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(qweight + rows[:, None] * (K // 8) + words[None, :],
                         mask=words[None, :] < K // 8, other=0)
        shifts = tl.arange(0, 8) * 4
        codes = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
        codes = tl.reshape(codes, (BLOCK_N, BLOCK_K))
        group = rows * n_groups + k // group_size
        scale = tl.load(scales + group).to(tl.float32)
        zero = tl.load(zeros + group).to(tl.float32)
        return ((codes.to(tl.float32) - zero[:, None]) * scale[:, None]).to(dtype)

    @triton.jit
    def _w4a16_kernel(x, qweight, scales, zeros, bias, out, M, N, K, n_groups, group_size,
                      k_per_split, stride_xm, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
        wait_for_predecessor(PDL)
        tile, split = tl.program_id(0), tl.program_id(1)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # past the end: row N - 1, never stored
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        dtype = x.dtype.element_ty
        if DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        for k in range(k_begin, k_end, BLOCK_K):
            w_tile = _dequantized_tile(qweight, scales, zeros, rows, k, n_groups, group_size, K,
                                       BLOCK_N, BLOCK_K, dtype)
            x_tile = tl.load(x + offs_m[:, None] * stride_xm + k + offs_k[None, :],
                             mask=m_mask[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
            if DOT:
                acc = tl.dot(x_tile, tl.trans(w_tile), acc, input_precision=DOT_PRECISION)
            else:
                acc += x_tile.to(tl.float32)[:, None, :] * w_tile.to(tl.float32)[None, :, :]
        if not DOT:
            acc = tl.sum(acc, axis=2)
        if HAS_BIAS:
            acc += tl.load(bias + rows).to(tl.float32)[None, :]
        mask = m_mask[:, None] & (offs_n < N)[None, :]
        ptrs = out + split * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ptrs, acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequantize_kernel(qweight, scales, zeros, out, N, K, n_groups, group_size,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        wait_for_predecessor(PDL)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        tile = _dequantized_tile(qweight, scales, zeros, rows, k, n_groups, group_size, K,
                                 BLOCK_N, BLOCK_K, out.dtype.element_ty)
        offs_k = k + tl.arange(0, BLOCK_K)
        mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        tl.store(out + rows[:, None] * K + offs_k[None, :], tile, mask=mask)
