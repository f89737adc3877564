"""Skinny GEMM: y[M, N] = x[M, K] @ W[N, K]^T for decode-sized M (1..16) in one Triton kernel.

At bs=1..16 a linear layer is a read of its weight: the time is the weight's bytes over the
memory bandwidth. cuBLAS reaches that on the large 8B matrices but runs the small ones (1B's
qkv and o_proj) at 45-65 % of it, and reduces its split-K partials in a second kernel. Here:

- The grid is (N tiles) x (SPLIT_K slices of K). With SPLIT_K > 1 every program stores its
  fp32 partial tile in a scratch buffer and counts its arrival on its N tile's counter; the
  last to arrive sums the SPLIT_K partials in the fixed order s = 0..SPLIT_K-1 (the result does
  not depend on which program came last), applies the epilogue, stores y and sets the counter
  back to zero for the next launch or CUDA-graph replay. No second kernel, no host sync.
- Epilogues: a bias add, and SiLU-and-mul for the fused gate/up weight [2I, K] (gate rows
  0..I-1, up rows I..2I-1): a program reads a gate tile and the matching up tile and writes
  silu(gate) * up [M, I], so the activation kernel disappears. The roundings are the unfused
  path's: the GEMM's output (bias added in fp32, as cuBLAS's epilogue does) rounded to the
  activation dtype, then `silu_and_mul`'s.
- The rows are padded to 16 for `tl.dot` (tensor cores), or, with `SkinnyConfig.dot` off, the
  tile is reduced with multiply-and-sum on the CUDA cores (rows padded to a power of two; the
  default for M = 1, where a 16-row MMA wastes 15/16 of its work).

Workspace: the partials and the arrival counters of one device are shared by every call site
(`workspace_for`), sized once, never reallocated (CUDA graphs keep its addresses). Two skinny
GEMMs must therefore not run at the same time on one device: the engine runs every forward on
its one forward stream, which orders them. A caller with concurrent streams passes each
stream its own `SkinnyWorkspace`.

The Triton interpreter's `tl.dot` is wrong for bfloat16 operands, and it truncates fp32 to
bf16 where a GPU rounds to nearest even: test the dot path in fp32 there and the roundings in
fp16 (the multiply-and-sum path is right in every dtype).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from specserve.engine.layers.activation import silu_and_mul
from specserve.engine.pdl import launch_options, wait_for_predecessor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build needs no Triton
    triton = None

MAX_ROWS = 16                          # M above this goes to cuBLAS
PARTIAL_CAPACITY = 4 * 1024 * 1024     # fp32 partial values in a device's workspace (16 MiB)
COUNTER_CAPACITY = 8192                # arrival counters (N tiles of one split-K launch)


class SkinnyConfig(NamedTuple):
    """Launch parameters of one skinny GEMM."""

    block_n: int      # output columns per program (per half with SiLU-and-mul)
    block_k: int      # reduction step
    split_k: int      # programs sharing one N tile's reduction
    num_warps: int
    num_stages: int
    dot: bool = True  # tl.dot on rows padded to 16; False: multiply-and-sum (small M)


class SkinnyWorkspace:
    """fp32 split-K partials and int32 arrival counters (zero between launches)."""

    def __init__(self, device: torch.device, partial_capacity: int = PARTIAL_CAPACITY,
                 counter_capacity: int = COUNTER_CAPACITY):
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny GEMM workspace: create it (run one skinny GEMM) before "
                               "capturing a CUDA graph")
        self.partials = torch.empty(partial_capacity, dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(counter_capacity, dtype=torch.int32, device=device)


_WORKSPACES: dict[torch.device, SkinnyWorkspace] = {}


def workspace_for(device: torch.device) -> SkinnyWorkspace:
    """The device's shared workspace, made on first use."""
    if device not in _WORKSPACES:
        _WORKSPACES[device] = SkinnyWorkspace(device)
    return _WORKSPACES[device]


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: an H100's count, so CPU tests see the GPU's configs


# Measured best configs, (m, n, k, silu_mul) -> config, as `bench/skinny_gemm.py --sweep`
# prints them; shapes not listed take the rule of `default_config`.
TUNED_CONFIGS: dict[tuple[int, int, int, bool], SkinnyConfig] = {}

# (N, K) of a weight -> the largest M the skinny kernel runs it for (cuBLAS above), from
# `bench/skinny_gemm.py`; weights not listed: MAX_ROWS.
SKINNY_MAX_ROWS: dict[tuple[int, int], int] = {}


@functools.lru_cache(maxsize=None)  # one entry per (shape, M, device): no host work per call
def default_config(m: int, n: int, k: int, silu_mul: bool = False,
                   device: torch.device = torch.device("cuda")) -> SkinnyConfig:
    """Launch parameters for y[m, n] = x[m, k] W^T (n: output columns, I with SiLU-and-mul).

    `TUNED_CONFIGS` where measured, else the rule the H100 sweep of the Llama 8B shapes
    (`bench/skinny_gemm.py --sweep`, docs/benchmarks.md) points to for every M up to 16:
    32-column tiles on tl.dot, K split in two until there is about a program an SM (each
    still streaming at least 512 of K), 256-wide K steps in three stages when K is not split,
    128-wide in four when it is. Wider tiles or more splits than that measured slower: at
    M <= 16 every program is a stream of weight rows, and the fewer programs share an SM, the
    fewer of their loads wait behind one another.
    """
    if (m, n, k, silu_mul) in TUNED_CONFIGS:
        return TUNED_CONFIGS[m, n, k, silu_mul]
    block_n = 32
    tiles = triton.cdiv(n, block_n)
    split_k = 1
    while (tiles * split_k < _num_sms(device) and k // (2 * split_k) >= 512
           and _scratch_values(split_k * 2, m, n, silu_mul) <= PARTIAL_CAPACITY):
        split_k *= 2
    if split_k == 1:
        return SkinnyConfig(block_n=block_n, block_k=256, split_k=1, num_warps=4, num_stages=3)
    return SkinnyConfig(block_n=block_n, block_k=128, split_k=split_k, num_warps=4, num_stages=4)


def prefers_skinny(m: int, n: int, k: int) -> bool:
    """The per-shape choice between this kernel and cuBLAS (F.linear) for a weight [n, k] and
    1 <= m rows: every decode-sized M unless `SKINNY_MAX_ROWS` says otherwise."""
    return m <= SKINNY_MAX_ROWS.get((n, k), MAX_ROWS)


def _scratch_values(split_k: int, m: int, n: int, silu_mul: bool) -> int:
    return split_k * m * n * (2 if silu_mul else 1)


def can_use(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_gemm(x, weight)` runs here and the per-shape rule picks it."""
    if triton is None or not x.is_cuda or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    n, k = weight.shape
    m = x.numel() // k if k else 0
    return 1 <= m and prefers_skinny(m, n, k)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           skinny: bool = True) -> torch.Tensor:
    """F.linear(x, weight, bias), by the skinny GEMM where `can_use` picks it and `skinny`
    allows it (the layers' A/B switch)."""
    if skinny and can_use(x, weight):
        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                        skinny: bool = True) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight, bias)) for a fused [2I, K] gate/up weight: one kernel
    where the skinny GEMM runs, else the GEMM and then the activation kernel."""
    if skinny and can_use(x, weight):
        return skinny_gemm(x, weight, bias, silu_mul=True)
    return silu_and_mul(F.linear(x, weight, bias))


if triton is not None:
    @triton.jit
    def _accumulate(acc, x_tile, w_tile, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
        if DOT:  # acc [BLOCK_M, BLOCK_N]
            acc = tl.dot(x_tile, tl.trans(w_tile), acc, input_precision=DOT_PRECISION)
        else:
            # acc [BLOCK_M, BLOCK_N, BLOCK_K]: products summed per lane, reduced over K once
            # after the loop (no cross-thread reduction per step).
            acc += x_tile.to(tl.float32)[:, None, :] * w_tile.to(tl.float32)[None, :, :]
        return acc

    @triton.jit
    def _epilogue(acc, acc_up, bias, y, offs_m, offs_n, mask, n_cols, stride_ym,
                  HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
        dtype = y.dtype.element_ty
        n_mask = offs_n < n_cols
        if HAS_BIAS:
            acc += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            if HAS_BIAS:
                acc_up += tl.load(bias + n_cols + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            # The unfused path: the GEMM rounds gate and up to the activation dtype, then
            # silu_and_mul rounds silu(gate) and the product.
            gate = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            acc = act * up
        ptrs = y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(ptrs, acc.to(dtype), mask=mask)

    @triton.jit
    def _skinny_gemm_kernel(
        x, w, bias, y, partials, arrivals, M, n_cols, K, k_per_split,
        stride_xm, stride_wn, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
        DOT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):
        # n_cols: output columns (I with SILU_MUL, whose weight has 2 * I rows).
        wait_for_predecessor(PDL)
        tile = tl.program_id(0)
        split = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < n_cols
        # Rows past the weight's end read row 0 instead of being masked: their columns are
        # never stored, and the unmasked loads stay vectorized.
        w_rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
        x_ptrs = x + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w + w_rows[:, None] * stride_wn + offs_k[None, :]
        up_ptrs = w + (w_rows + n_cols)[:, None] * stride_wn + offs_k[None, :]
        if DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        for k in range(k_begin, k_end, BLOCK_K):
            if EVEN_K:
                x_tile = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
                w_tile = tl.load(w_ptrs + k)
            else:
                k_mask = (k + offs_k) < K
                x_tile = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                w_tile = tl.load(w_ptrs + k, mask=k_mask[None, :], other=0.0)
            acc = _accumulate(acc, x_tile, w_tile, DOT, DOT_PRECISION)
            if SILU_MUL:
                if EVEN_K:
                    up_tile = tl.load(up_ptrs + k)
                else:
                    up_tile = tl.load(up_ptrs + k, mask=k_mask[None, :], other=0.0)
                acc_up = _accumulate(acc_up, x_tile, up_tile, DOT, DOT_PRECISION)
        if not DOT:
            acc = tl.sum(acc, axis=2)
            acc_up = tl.sum(acc_up, axis=2)

        out_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            _epilogue(acc, acc_up, bias, y, offs_m, offs_n, out_mask, n_cols, stride_ym,
                      HAS_BIAS, SILU_MUL)
        else:
            # partials[s, m, c]: c < n_cols the (gate) sums, n_cols + c the up sums.
            width = n_cols * (2 if SILU_MUL else 1)
            p_ptrs = partials + offs_m[:, None] * width + offs_n[None, :]
            split_stride = M * width
            tl.store(p_ptrs + split * split_stride, acc, mask=out_mask)
            if SILU_MUL:
                tl.store(p_ptrs + split * split_stride + n_cols, acc_up, mask=out_mask)
            # Every thread's partial stores come before the arrival (a CTA barrier, then the
            # atomic's release); the last program reads the others' after its acquire, from L2.
            tl.debug_barrier()
            counter = arrivals + tile
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
                tl.debug_barrier()
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(0, SPLIT_K):  # a fixed order: deterministic sums
                    acc += tl.load(p_ptrs + s * split_stride, mask=out_mask, other=0.0,
                                   cache_modifier=".cg")
                    if SILU_MUL:
                        acc_up += tl.load(p_ptrs + s * split_stride + n_cols, mask=out_mask,
                                          other=0.0, cache_modifier=".cg")
                _epilogue(acc, acc_up, bias, y, offs_m, offs_n, out_mask, n_cols, stride_ym,
                          HAS_BIAS, SILU_MUL)
                tl.store(counter, 0)  # ready for the next launch (and the next graph replay)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                silu_mul: bool = False, config: Optional[SkinnyConfig] = None,
                workspace: Optional[SkinnyWorkspace] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] with at most `MAX_ROWS` rows, or with
    `silu_mul` `silu_and_mul(F.linear(x, weight, bias))` (weight [2I, K]: gate rows, then up
    rows; the result [..., I]). `weight` contiguous, x's last dimension contiguous, one dtype."""
    n_rows, k = weight.shape
    assert weight.is_contiguous() and x.shape[-1] == k and x.dtype == weight.dtype
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    assert 1 <= m <= MAX_ROWS, f"skinny_gemm: {m} rows (1..{MAX_ROWS})"
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if silu_mul:
        assert n_rows % 2 == 0, "silu_mul needs the fused [2I, K] gate/up weight"
    n_cols = n_rows // 2 if silu_mul else n_rows
    if bias is not None:
        assert bias.shape == (n_rows,) and bias.is_contiguous()
    config = config or default_config(m, n_cols, k, silu_mul, x.device)
    y = torch.empty((m, n_cols), dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    tiles = triton.cdiv(n_cols, config.block_n)
    if config.split_k > 1:
        workspace = workspace or workspace_for(x.device)
        assert _scratch_values(config.split_k, m, n_cols, silu_mul) <= workspace.partials.numel()
        assert tiles <= workspace.arrivals.numel()
        partials, arrivals = workspace.partials, workspace.arrivals
    else:
        partials, arrivals = y, y  # unused
    _skinny_gemm_kernel[(tiles, config.split_k)](
        x2, weight, bias if bias is not None else weight, y, partials, arrivals, m, n_cols, k,
        k_per_split, x2.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)) if config.dot else triton.next_power_of_2(m),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, DOT=config.dot, EVEN_K=k % config.block_k == 0,
        # fp32 operands would silently run as TF32 on tensor cores; keep them exact.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x.device),
    )
    return y.view(*x.shape[:-1], n_cols)
