"""FP8-weight matrix products outside the skinny GEMM's range (prefill, large batches, the CPU),
and the Triton pieces every FP8 kernel shares.

- CPU (and CUDA without FP8 support, fp32 activations, or a scale grid the kernel does not
  take): dequantise the weight and run F.linear in the activation dtype (exactly
  `fp8_linear_reference`).
- CUDA, compute capability 8.9 or newer, 16-bit activations: W8A8 on FP8 tensor cores, the
  DeepSeek-V3 recipe.
  `quantize_activations` (one small kernel) quantises x per token per 128-column group,
  dynamically: scale = amax(|group|) / 448, x8 = x / scale rounded to float8_e4m3fn. Then
  `_block_scaled_gemm_kernel` takes 128-wide K steps (one activation group, and within one
  k-block of the weight's scale grid): each step's FP8 product is accumulated in fp32 times
  its row's activation scale and its columns' weight scales. A bias is added in fp32, the
  result rounded once to the activation dtype. Tails of M, N and K are masked (the K tail
  loads zeros), so no dimension needs to be a multiple of a block. Every size is known on the
  host and nothing is read back: the launches are capturable in a CUDA graph.

The error against the reference (which rounds the dequantised weight to the activation dtype
and keeps x unquantised) is the activations' FP8 rounding: about 2^-4 of an element's
magnitude, relative to a group's largest at worst, averaging out over K (measured in
bench/fp8_gemm.py).

Shared with the skinny GEMM and the fused MoE kernels (engine/layers): `weight_scales` and
`dequantize_tile` (W8A16: the FP8 weight tile dequantised in fp32 and rounded to the
activation dtype before the dot, the reference's roundings; the e4m3 values widened by
Triton's casts or, with "bits", by engine/layers/fp8_convert.py's byte moves), `scaled_dot`
(W8A8's per-step scaling) and `k_uniform` (whether a config's K steps each lie in one k-block
of the grid).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from specserve.engine.pdl import launch_options, wait_for_predecessor
from specserve.engine.layers.fp8_weight import FP8_DTYPE, FP8_MAX, WeightScale, fp8_linear_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build needs no Triton
    triton = None

ACT_GROUP = 128          # activation columns per dynamic scale (DeepSeek-V3's 1x128 groups)
_GROUPS_PER_PROGRAM = 8  # activation groups one quantiser program handles
# Smallest activation scale: an all-zero group quantises to zeros instead of 0 / 0.
_MIN_AMAX = 1e-12


class BlockScaledConfig(NamedTuple):
    """Launch parameters of the large-M W8A8 GEMM (BLOCK_K is ACT_GROUP or a divisor of it)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles swept together (the weight tile stays in L2 across them)


def default_block_scaled_config(m: int) -> BlockScaledConfig:
    """Not yet tuned on a device (bench/fp8_gemm.py times it): FP8 wgmma wants 64 rows a
    warpgroup, so 64-row tiles while M is small, 128 x 128 tiles in 8 warps beyond."""
    if m <= 64:
        return BlockScaledConfig(block_m=64, block_n=64, block_k=ACT_GROUP, num_warps=4, num_stages=4)
    if m <= 256:
        return BlockScaledConfig(block_m=64, block_n=128, block_k=ACT_GROUP, num_warps=4, num_stages=4)
    return BlockScaledConfig(block_m=128, block_n=128, block_k=ACT_GROUP, num_warps=8, num_stages=3)


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)  # asked by every FP8 linear layer of a forward
def device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def fp8_supported(device: torch.device) -> bool:
    """FP8 conversions and tensor cores: CUDA compute capability 8.9 (Ada) or newer."""
    return triton is not None and device.type == "cuda" and device_capability(device) >= (8, 9)


def k_uniform(scale_block_k: int, k: int, block_k: int) -> bool:
    """Whether each K step of `block_k` (steps start at multiples of it) lies in one k-block,
    `scale_block_k` wide, of the scale grid: one scale per weight row and step instead of one
    per element."""
    return scale_block_k % block_k == 0 or scale_block_k >= k


def check_weight(weight: torch.Tensor, scale: WeightScale) -> None:
    """An FP8 weight [..., N, K] and a scale grid that covers it (row-major in its last two
    dimensions, as the kernels index it)."""
    n, k = weight.shape[-2:]
    assert weight.dtype == FP8_DTYPE, f"an FP8 weight is {FP8_DTYPE}, not {weight.dtype}"
    assert scale.values.dtype == torch.float32 and scale.values.shape[:-2] == weight.shape[:-2]
    assert scale.values.shape[-2:] == (-(-n // scale.block_n), -(-k // scale.block_k)), \
        f"scale grid {tuple(scale.values.shape)} does not cover {tuple(weight.shape)} in {scale.block_n}x{scale.block_k} blocks"
    assert scale.values.stride(-1) == 1


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [M, K] float8_e4m3fn, scales [M, ceil(K / ACT_GROUP)] fp32), in torch:
    what `quantize_activations` computes, the same fp32 operations."""
    m, k = x.shape
    groups = -(-k // ACT_GROUP)
    padded = torch.nn.functional.pad(x.float(), (0, groups * ACT_GROUP - k)).view(m, groups, ACT_GROUP)
    scales = padded.abs().amax(dim=-1).clamp(min=_MIN_AMAX) / FP8_MAX
    x8 = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x8.view(m, -1)[:, :k], scales


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dimension contiguous) -> (x8 [M, K] float8_e4m3fn, scales
    [M, ceil(K / ACT_GROUP)] fp32): per token and 128-column group, scale = amax / 448."""
    m, k = x.shape
    x8 = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, triton.cdiv(k, ACT_GROUP)), dtype=torch.float32, device=x.device)
    _quantize_into(x, x8, scales)
    return x8, scales


def _quantize_into(x: torch.Tensor, x8: torch.Tensor, scales: torch.Tensor) -> None:
    """`quantize_activations` into x8 (rows [M, K] contiguous, at least x's rows) and scales
    (at least [M, groups], any strides: cuBLAS reads them column-major)."""
    m, k = x.shape
    assert x.stride(-1) == 1 and x8.is_contiguous()
    if m:
        groups = triton.cdiv(k, ACT_GROUP)
        grid = (m, triton.cdiv(groups, _GROUPS_PER_PROGRAM))
        _quantize_groups_kernel[grid](
            x, x8, scales, k, groups, x.stride(0), scales.stride(0), scales.stride(1),
            GROUP=ACT_GROUP, GROUPS_PER_PROGRAM=_GROUPS_PER_PROGRAM, MIN_AMAX=_MIN_AMAX,
            FP8_MAX_VALUE=FP8_MAX, num_warps=4, **launch_options(x.device))


def block_scaled_matmul(x: torch.Tensor, weight: torch.Tensor, scale: WeightScale,
                        bias: Optional[torch.Tensor] = None,
                        config: Optional[BlockScaledConfig] = None) -> torch.Tensor:
    """x [..., K] @ (FP8 weight [N, K] with its scale grid)^T (+ bias) in x's dtype, W8A8:
    x quantised per token per 128-column group, FP8 products, scales applied per K step."""
    n, k = weight.shape
    check_weight(weight, scale)
    assert weight.is_contiguous() and x.shape[-1] == k
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    config = config or default_block_scaled_config(m)
    assert ACT_GROUP % config.block_k == 0 and k_uniform(scale.block_k, k, config.block_k), \
        f"K steps of {config.block_k} must lie in one activation group and one weight k-block " \
        f"({scale.block_n}x{scale.block_k})"
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        x8, x_scales = quantize_activations(x2 if x2.stride(-1) == 1 else x2.contiguous())
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
        _block_scaled_gemm_kernel[grid](
            x8, x_scales, weight, scale.values, bias if bias is not None else y, y, m, n, k,
            x8.stride(0), x_scales.stride(0), weight.stride(0), scale.values.stride(0),
            scale.block_n, scale.block_k, HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
            **launch_options(x.device))
    return y.view(*x.shape[:-1], n)


def runs_block_scaled(x: torch.Tensor, weight: torch.Tensor, scale: WeightScale) -> bool:
    """Whether `fp8_matmul` takes the W8A8 kernel: CUDA with FP8, 16-bit activations (an fp32
    engine, the exact mode tests compare with transformers, keeps the reference), a 2-D
    contiguous weight, and a scale grid whose k-blocks are whole 128-column steps (or one
    block over all of K)."""
    return (x.is_cuda and fp8_supported(x.device) and weight.dim() == 2 and weight.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16)
            and k_uniform(scale.block_k, weight.shape[1], ACT_GROUP))


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: WeightScale,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T (+ bias) in x's dtype: cuBLAS's blockwise FP8
    GEMM where `runs_cublas_blockwise`, else the Triton W8A8 kernel where
    `runs_block_scaled`, else the reference."""
    if runs_block_scaled(x, weight, scale):
        if runs_cublas_blockwise(x, weight, scale):
            return cublas_blockwise_matmul(x, weight, scale, bias)
        return block_scaled_matmul(x, weight, scale, bias)
    return fp8_linear_reference(x, weight, scale, bias)


def runs_cublas_blockwise(x: torch.Tensor, weight: torch.Tensor, scale: WeightScale) -> bool:
    """cuBLAS (through torch._scaled_mm) takes 1x128 activation and 128x128 weight scales on
    Hopper, with N and K whole blocks, more than one row, and the weight grid's rows (read
    transposed: K / 128 apart) 16-byte aligned: with K = 384 (the demo model) cuBLAS reads
    the grid wrongly without an error (the demo's perplexity went from 3.06 to 1e5). Measured on an H100
    (bench/fp8_gemm.py): 1.6x faster than the bf16 GEMM at M = 4096, and faster than the
    Triton W8A8 kernel at every M it takes (8B gate_up: 873 vs 1857 us at 4096)."""
    n, k = weight.shape
    return (device_capability(x.device) == (9, 0) and scale.block_n == ACT_GROUP
            and scale.block_k == ACT_GROUP and n % ACT_GROUP == 0 and k % (4 * ACT_GROUP) == 0
            and x.numel() // k > 1)


CUBLAS_ROW_ALIGN = 4  # cuBLAS wants the column-major activation scales' rows 16-byte aligned


def cublas_blockwise_matmul(x: torch.Tensor, weight: torch.Tensor, scale: WeightScale,
                            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`fp8_matmul` by torch._scaled_mm: the same activation quantisation (1x128 groups) as the
    Triton kernel, cuBLAS's block-scaled FP8 GEMM. cuBLAS reads the activation scales
    column-major and the weight grid transposed ([K/128, N/128]); the rows are padded to a
    multiple of 4 (the padding rows' products are computed from whatever the buffers hold and
    dropped)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    rows = -(-m // CUBLAS_ROW_ALIGN) * CUBLAS_ROW_ALIGN
    x8 = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((k // ACT_GROUP, rows), dtype=torch.float32, device=x.device).t()
    _quantize_into(x2 if x2.stride(-1) == 1 else x2.contiguous(), x8, scales)
    y = torch._scaled_mm(x8, weight.t(), scale_a=scales, scale_b=scale.values.t(), out_dtype=x.dtype)[:m]
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


if triton is not None:
    from specserve.engine.layers.fp8_convert import e4m3_to_f32, round_to_bf16

    _ACT_GROUP = tl.constexpr(ACT_GROUP)

    @triton.jit
    def weight_scales(scale, scale_rows, k, offs_k, K, scale_block_k, K_UNIFORM: tl.constexpr):
        """The fp32 scales of a weight tile whose K step starts at k: `scale_rows` the offsets
        of its rows' grid rows and `offs_k` its columns, each shaped to broadcast against the
        other ([BN, 1] and [1, BK], or transposed). K_UNIFORM (`k_uniform`): one column of the
        grid, shaped like `scale_rows`; else one scale per element (columns past K read the
        last one: their weights are zeros)."""
        if K_UNIFORM:
            cols = k // scale_block_k
        else:
            cols = tl.minimum(k + offs_k, K - 1) // scale_block_k
        return tl.load(scale + scale_rows + cols)

    @triton.jit
    def dequantize_tile(w_tile, scales, dtype: tl.constexpr, FP8_CONVERT: tl.constexpr,
                        DOT: tl.constexpr):
        """W8A16: the weight tile in fp32 times its scales, rounded to the activation dtype as
        `dequantize(weight, scale, x.dtype)` rounds it (the reference's weight, bit for bit).
        FP8_CONVERT (engine/layers/fp8_convert.py) says how the e4m3 values become fp32 and
        `round_weight` how the products are rounded (DOT: for tl.dot, else for the CUDA
        cores' multiply-and-sum)."""
        return round_weight(e4m3_to_f32(w_tile, FP8_CONVERT) * scales, dtype, FP8_CONVERT, DOT)

    @triton.jit
    def round_weight(w, dtype: tl.constexpr, FP8_CONVERT: tl.constexpr, DOT: tl.constexpr):
        """Dequantised fp32 weights rounded to the activation dtype: converted to it for tl.dot
        (one packed conversion a pair); with "bits", bf16 and no dot, rounded to bf16 by integer
        operations and kept fp32 (`round_to_bf16`), which the multiply-and-sum takes as it is
        instead of converting to bf16 and back. The same values either way."""
        if DOT or FP8_CONVERT == "cast" or dtype != tl.bfloat16:
            return w.to(dtype)
        else:
            return round_to_bf16(w)

    @triton.jit
    def activation_scales(x_scales, rows, row_mask, stride_row, k):
        """The dynamic scales of `rows` for the activation group holding column k."""
        return tl.load(x_scales + rows * stride_row + k // _ACT_GROUP, mask=row_mask, other=0.0)

    @triton.jit
    def scaled_dot(acc, a_tile, b_tile, a_scales, b_scales):
        """W8A8: one K step's FP8 product a b^T ([rows of a, rows of b], both K-major as FP8
        tensor cores want them) in fp32, times the scales of a's rows and of b's rows, added to
        acc (the step lies in one activation group and one weight k-block)."""
        return acc + tl.dot(a_tile, tl.trans(b_tile)) * a_scales[:, None] * b_scales[None, :]

    @triton.jit
    def _quantize_groups_kernel(x, x8, scales, K, num_groups, stride_xm, stride_sm, stride_sg,
                                GROUP: tl.constexpr,
                                GROUPS_PER_PROGRAM: tl.constexpr, MIN_AMAX: tl.constexpr,
                                FP8_MAX_VALUE: tl.constexpr, PDL: tl.constexpr):
        wait_for_predecessor(PDL)
        row = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = cols < K
        v = tl.load(x + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(v), axis=1), MIN_AMAX) / FP8_MAX_VALUE
        # Correctly rounded division, as torch divides (`/` on fp32 is approximate on a GPU).
        q = tl.clamp(tl.math.div_rn(v, s[:, None]), -FP8_MAX_VALUE, FP8_MAX_VALUE)
        tl.store(x8 + row * K + cols, q.to(x8.dtype.element_ty), mask=mask)
        tl.store(scales + row * stride_sm + groups * stride_sg, s, mask=groups < num_groups)

    @triton.jit
    def _block_scaled_gemm_kernel(
        x8, x_scales, w, w_scale, bias, y, M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn,
        scale_block_n, scale_block_k, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_for_predecessor(PDL)
        # Row tiles in groups of GROUP_M per column tile: consecutive programs share weight tiles.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
        tile_n = (pid % (GROUP_M * tiles_n)) // group_rows
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # Rows and columns past the end read the last one (never stored): unmasked loads.
        rows = tl.minimum(offs_m, M - 1).to(tl.int64)
        cols = tl.minimum(offs_n, N - 1).to(tl.int64)
        x_ptrs = x8 + rows[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w + cols[:, None] * stride_wn + offs_k[None, :]
        scale_rows = (cols // scale_block_n) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                x_tile = tl.load(x_ptrs + k)
                w_tile = tl.load(w_ptrs + k)
            else:
                k_mask = (k + offs_k) < K
                x_tile = tl.load(x_ptrs + k, mask=k_mask[None, :], other=0.0)
                w_tile = tl.load(w_ptrs + k, mask=k_mask[None, :], other=0.0)
            acc = scaled_dot(acc, x_tile, w_tile,
                             activation_scales(x_scales, rows, offs_m < M, stride_xsm, k),
                             weight_scales(w_scale, scale_rows, k, offs_k, K, scale_block_k, True))
        if HAS_BIAS:
            acc += tl.load(bias + cols).to(tl.float32)[None, :]
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(y + rows[:, None] * N + offs_n[None, :], acc.to(y.dtype.element_ty), mask=mask)
