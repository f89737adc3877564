"""Fused MoE experts in Triton (CUDA; the interpreter runs them on the CPU in tests).

`fused_experts` computes, for every token t with routed experts e_1..e_k and weights w_j,
`sum_j w_j * W2[e_j] @ (silu(W_gate[e_j] @ x_t) * (W_up[e_j] @ x_t))` in three launches:

1. `_align_kernel` (one program) sorts the T*k (token, expert) entries by expert on the
   device: expert e's entries occupy rows `[start_e, start_e + count_e)` of `sorted_entries`,
   each expert's run padded to a multiple of BLOCK_M with a sentinel, and `block_experts[b]`
   names the expert of row block b. The padded total stays on the device; the grids are sized
   from the host bound `T*k + min(E, T*k) * (BLOCK_M - 1)` and blocks past the total exit at
   once, so nothing waits on the host and a CUDA graph captured at a fixed T replays for any
   routing.
2. `_grouped_gemm_kernel` (gated): every row block multiplies its tokens' hidden states by its
   expert's gate and up rows at once (two accumulators over the same A tile) and stores
   silu(gate) * up, one row per entry.
3. `_grouped_gemm_kernel` (weighted): the down projection, the entry's top-k weight applied in
   the epilogue; the k rows of a token are then summed.

Weights stay in their checkpoint layout: w13 [E, 2I, H] (gate rows, then up rows) and
w2 [E, H, I], read as [K, N] tiles through their strides. FP8 experts (W8A16): each weight
tile is dequantised in fp32 with its expert's scale grid (quantization/fp8.py) and rounded to
the activation dtype before the dot, as the torch path's `dequantize` does; one scale per
column a K step where the step lies in one k-block of the grid, else one per element.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from specserve.engine.quantization.fp8 import WeightScale
from specserve.engine.quantization.fp8_gemm import (
    check_weight, dequantize_tile, k_uniform, weight_scales)


class MoEConfig(NamedTuple):
    """Launch parameters of the grouped GEMMs."""

    block_m: int     # entries (token, expert pairs) per row block; each expert pads to it
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_moe_config(num_tokens: int, top_k: int, num_experts: int,
                       device: torch.device) -> MoEConfig:
    if torch.device(device).type != "cuda":
        # Interpreter: the values only need to be legal (tl.dot takes 16 rows at least).
        return MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    # Few entries per expert (decode): the GEMMs stream weights, so a small row block wastes
    # least on padding and narrow N tiles give enough programs to pull the bandwidth;
    # many entries per expert (prefill) want larger tiles for tensor-core reuse. Not yet tuned
    # on a device: bench/mla_moe_kernels.py --sweep times alternatives.
    entries_per_expert = num_tokens * top_k / num_experts
    if entries_per_expert <= 4:
        return MoEConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if entries_per_expert <= 32:
        return MoEConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return MoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


class ExpertAlignment(NamedTuple):
    """Entries (row t*k + j of the flattened top-k ids) sorted by expert, on the device."""

    sorted_entries: torch.Tensor   # [max_padded] int32; padding rows hold num_entries
    block_experts: torch.Tensor    # [max_padded // block_m] int32, the expert of each block
    num_padded: torch.Tensor       # [1] int32, rows in use (a multiple of block_m)


@triton.jit
def _align_kernel(topk_ids, sorted_entries, block_experts, num_padded, num_entries,
                  max_padded, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    offs_t = tl.arange(0, BLOCK_T)
    # Entries per expert, as a histogram over chunks of entries (one-hot rows summed).
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, num_entries, BLOCK_T):
        entries = start + offs_t
        experts = tl.load(topk_ids + entries, mask=entries < num_entries, other=-1)
        counts += tl.sum((experts[:, None] == offs_e[None, :]).to(tl.int32), 0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(num_padded, tl.sum(padded, 0))

    # Row block b belongs to the first expert whose run ends past it (the count of runs that
    # end at or before it); blocks past the total are never read.
    for start in range(0, max_padded // BLOCK_M, BLOCK_T):
        blocks = start + offs_t
        owner = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(block_experts + blocks, owner, mask=blocks < max_padded // BLOCK_M)

    for start in range(0, max_padded, BLOCK_T):
        rows = start + offs_t
        tl.store(sorted_entries + rows, tl.zeros([BLOCK_T], tl.int32) + num_entries,
                 mask=rows < max_padded)
    tl.debug_barrier()  # the padding sentinels land before the entries that overwrite them

    # Each entry goes to its expert's start + the number of that expert's entries before it
    # (earlier chunks: `seen`; this chunk: an exclusive prefix sum of the one-hot rows).
    seen = ends - padded
    for start in range(0, num_entries, BLOCK_T):
        entries = start + offs_t
        valid = entries < num_entries
        experts = tl.load(topk_ids + entries, mask=valid, other=-1)
        onehot = (experts[:, None] == offs_e[None, :]).to(tl.int32)
        earlier = tl.cumsum(onehot, 0) - onehot
        rows = tl.sum(onehot * (earlier + seen[None, :]), 1)
        tl.store(sorted_entries + rows, entries, mask=valid)
        seen += tl.sum(onehot, 0)


def align_entries_by_expert(topk_ids: torch.Tensor, num_experts: int,
                            block_m: int) -> ExpertAlignment:
    """Sort the flattened `topk_ids` [T, k] entries by expert, each expert's run padded to a
    multiple of `block_m`, without reading anything back to the host."""
    num_entries = topk_ids.numel()
    max_padded = num_entries + min(num_experts, num_entries) * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    device = topk_ids.device
    sorted_entries = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    # The [BLOCK_T, BLOCK_E] one-hot tile: at most about 16k elements, and no taller than the
    # entries need. One program runs it, so a decode step's few entries must not pay for a
    # prefill-sized tile: with 256-row tiles this kernel took 38 us a layer for 24 entries
    # on an H100 (bench/step_profile.py, DeepSeek-V2-Lite chain).
    block_t = max(16, min(triton.next_power_of_2(num_entries), 16384 // block_e, 256))
    tile = block_t * block_e
    num_warps = 1 if tile <= 1024 else 2 if tile <= 4096 else 4 if tile < 16384 else 8
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_entries, block_experts, num_padded, num_entries,
        max_padded, NUM_EXPERTS=num_experts, BLOCK_E=block_e, BLOCK_T=block_t,
        BLOCK_M=block_m, num_warps=num_warps)
    return ExpertAlignment(sorted_entries, block_experts, num_padded)


class _ExpertScales(NamedTuple):
    """The grouped GEMM's `fp8` argument: the stacked scale grids [E, rows, k-blocks] of FP8
    experts (any tensor and 1s for 16-bit experts: never read)."""

    grid: torch.Tensor  # (not `values`: a Triton tuple's own attribute)
    stride_expert: int
    stride_n: int
    block_n: int
    block_k: int


@triton.jit
def _grouped_gemm_kernel(
    a, w, out, sorted_entries, block_experts, num_padded, topk_weights, num_entries, N, K,
    stride_a_row, stride_w_expert, stride_w_n, stride_w_k, stride_out_row, fp8,
    ENTRIES_PER_A_ROW: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_WEIGHT: tl.constexpr, K_UNIFORM: tl.constexpr,
):
    """out[entry, n] for the entries of one row block and BLOCK_N output columns:
    A row `entry // ENTRIES_PER_A_ROW` times the block's expert's weight rows. GATED: the
    expert has 2N rows (gate, then up) and the result is silu(gate) * up. WEIGHTED: the
    result is scaled by `topk_weights[entry]`. FP8_WEIGHT: the weight tiles are dequantised
    with the expert's scales `fp8` (K_UNIFORM: a K step lies in one k-block)."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded):
        return
    expert = tl.load(block_experts + block).to(tl.int64)
    entries = tl.load(sorted_entries + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = entries < num_entries
    a_rows = (entries // ENTRIES_PER_A_ROW).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + a_rows[:, None] * stride_a_row + offs_k[None, :]
    w_ptrs = (w + expert * stride_w_expert + offs_n[None, :].to(tl.int64) * stride_w_n
              + offs_k[:, None] * stride_w_k)
    # The expert's scale grid and the offsets of the columns' grid rows, [1, BLOCK_N] against
    # the K steps (columns past N take the last one: never stored).
    scales = fp8.grid + expert * fp8.stride_expert
    cols = tl.minimum(offs_n, N - 1)
    scale_rows = ((cols // fp8.block_n) * fp8.stride_n)[None, :]
    up_scale_rows = (((N + cols) // fp8.block_n) * fp8.stride_n)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        a_tile = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_tile = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if FP8_WEIGHT:
            w_tile = dequantize_tile(w_tile, weight_scales(scales, scale_rows, k_start, offs_k[:, None],
                                                           K, fp8.block_k, K_UNIFORM), a_tile.dtype)
        acc = tl.dot(a_tile, w_tile, acc, input_precision=DOT_PRECISION)
        if GATED:
            up_tile = tl.load(w_ptrs + N * stride_w_n, mask=w_mask, other=0.0)
            if FP8_WEIGHT:
                up_tile = dequantize_tile(up_tile, weight_scales(scales, up_scale_rows, k_start,
                                                                 offs_k[:, None], K, fp8.block_k,
                                                                 K_UNIFORM), a_tile.dtype)
            acc_up = tl.dot(a_tile, up_tile, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:
        weights = tl.load(topk_weights + entries, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * weights[:, None]
    tl.store(out + entries.to(tl.int64)[:, None] * stride_out_row + offs_n[None, :],
             acc.to(out.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, alignment: ExpertAlignment,
                  topk_weights: Optional[torch.Tensor], entries_per_a_row: int, gated: bool,
                  config: MoEConfig, scale: Optional[WeightScale]) -> None:
    num_n = w.shape[1] // 2 if gated else w.shape[1]
    grid = (alignment.block_experts.shape[0], triton.cdiv(num_n, config.block_n))
    fp8 = _ExpertScales(a, 1, 1, 1, 1)
    if scale is not None:
        fp8 = _ExpertScales(scale.values, scale.values.stride(0), scale.values.stride(1),
                            scale.block_n, scale.block_k)
    _grouped_gemm_kernel[grid](
        a, w, out, alignment.sorted_entries, alignment.block_experts, alignment.num_padded,
        topk_weights if topk_weights is not None else a,  # unused unless weighted
        out.shape[0], num_n, w.shape[2],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0), fp8,
        ENTRIES_PER_A_ROW=entries_per_a_row, GATED=gated, WEIGHTED=topk_weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        # fp32 operands would run as TF32 on tensor cores; keep an fp32 engine exact.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        FP8_WEIGHT=scale is not None,
        K_UNIFORM=scale is not None and k_uniform(scale, w.shape[2], config.block_k),
        num_warps=config.num_warps, num_stages=config.num_stages)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  config: Optional[MoEConfig] = None, *, w13_scale: Optional[WeightScale] = None,
                  w2_scale: Optional[WeightScale] = None) -> torch.Tensor:
    """Routed experts' output [T, H] for x [T, H], w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I], topk_weights [T, k] (fp32) and topk_ids [T, k] (distinct experts a token).
    With scales, w13 and w2 are FP8 (both or neither; quantization/fp8.py, a grid per expert)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"hidden size {hidden}")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} must both be [{num_tokens}, k]")
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert (w13_scale is None) == (w2_scale is None), "FP8 experts carry both scale grids"
    if w13_scale is not None:
        check_weight(w13, w13_scale)
        check_weight(w2, w2_scale)
    else:
        assert w13.dtype == w2.dtype == x.dtype, "16-bit experts are in x's dtype"
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    config = config or default_moe_config(num_tokens, top_k, num_experts, x.device)
    alignment = align_entries_by_expert(topk_ids.contiguous(), num_experts, config.block_m)
    num_entries = num_tokens * top_k
    intermediate = x.new_empty(num_entries, two_inter // 2)
    _grouped_gemm(x, w13, intermediate, alignment, None, top_k, True, config, w13_scale)
    weighted = x.new_empty(num_entries, hidden)
    _grouped_gemm(intermediate, w2, weighted, alignment, topk_weights.contiguous(), 1, False,
                  config, w2_scale)
    return weighted.view(num_tokens, top_k, hidden).sum(1)
