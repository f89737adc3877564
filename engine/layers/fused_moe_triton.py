"""Fused MoE experts in Triton (CUDA; the interpreter runs them on the CPU in tests).

`fused_experts` computes, for every token t with routed experts e_1..e_k and weights w_j,
`sum_j w_j * W2[e_j] @ (silu(W_gate[e_j] @ x_t) * (W_up[e_j] @ x_t))` in three steps:

1. The alignment sorts the T*k (token, expert) entries by expert on the device: expert e's
   entries occupy rows `[start_e, start_e + count_e)` of `sorted_entries` in their original
   order, each expert's run padded to a multiple of BLOCK_M with a sentinel, and
   `block_experts[b]` names the expert of row block b. It runs over chunks of entries in
   parallel (`align_plan`): `_align_count_kernel` stores each chunk's entries per expert in a
   [chunks, E] table; `_align_scatter_kernel` then gives each chunk's entries their rows (the
   expert's padded start, plus its entries in earlier chunks, plus the entry's rank among
   its chunk's entries of that expert) and stores, on disjoint rows, the padding sentinels
   and block experts. A few hundred entries or fewer (decode) run as one scatter program that
   counts its own entries, in one launch. The padded total stays on the device; the grids are
   sized from the host bound `T*k + min(E, T*k) * (BLOCK_M - 1)` and blocks past the total
   exit at once, so nothing waits on the host and a CUDA graph captured at a fixed T replays
   for any routing.
2. `_grouped_gemm_kernel` (gated): every row block multiplies its tokens' hidden states by its
   expert's gate and up rows at once (two accumulators over the same A tile) and stores
   silu(gate) * up, one row per entry.
3. `_grouped_gemm_kernel` (weighted): the down projection, the entry's top-k weight applied in
   the epilogue; the k rows of a token are then summed.

Weights stay in their checkpoint layout: w13 [E, 2I, H] (gate rows, then up rows) and
w2 [E, H, I], read as [K, N] tiles through their strides. FP8 experts (W8A16): each weight
tile is dequantised in fp32 with its expert's scale grid (layers/fp8_weight.py) and rounded to
the activation dtype before the dot, as the torch path's `dequantize` does; one scale per
column a K step where the step lies in one k-block of the grid, else one per element.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from specserve.engine.layers.fp8_weight import WeightScale
from specserve.engine.layers.fp8_gemm import (
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


class AlignPlan(NamedTuple):
    """How `align_entries_by_expert` splits the entries: programs of `tiles` tiles of
    `block_t` entries each. One program (`num_programs == 1`) counts its own entries in one
    launch; more run a counting launch first."""

    block_t: int        # entries a tile: the [block_t, block_t] rank and one-hot tiles' rows
    tiles: int          # tiles a program
    num_programs: int
    num_warps: int


# Entries a tile: a program's [BLOCK_T, BLOCK_T] rank tile and [BLOCK_T, BLOCK_E] one-hot
# tile stay small (at most 8192 elements: BLOCK_T halves for E past 128), so a program costs
# a few loads and reductions and a call costs about one program once they run side by side.
# The expert axis is E's next power of two (128 lanes for 66 experts: V2-Lite's 64 and its 2
# shared slots); only those two tiles and the vectors over experts see it, not the
# entries' ranks, so it is not tiled. At most ALIGN_MAX_PROGRAMS programs: each reads the
# whole [programs, E] count table, so past about an H100's SM count a program takes more
# tiles instead.
ALIGN_BLOCK_T = 64
ALIGN_MAX_PROGRAMS = 128
# Up to this many tiles of entries (a decode step's tens to a few hundred entries) run as one
# program that counts its own entries: one launch instead of two.
ALIGN_SINGLE_PROGRAM_TILES = 4


def align_plan(num_entries: int, num_experts: int, block_t: int = ALIGN_BLOCK_T,
               max_programs: int = ALIGN_MAX_PROGRAMS,
               single_program_tiles: int = ALIGN_SINGLE_PROGRAM_TILES) -> AlignPlan:
    """The split of `num_entries` (a function of T and k only, so fixed in a captured graph)."""
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(16, min(block_t, triton.next_power_of_2(max(num_entries, 1)),
                          max(16, 8192 // block_e)))
    num_tiles = max(1, triton.cdiv(num_entries, block_t))
    if num_tiles <= single_program_tiles:
        tiles, num_programs = num_tiles, 1
    else:
        tiles = triton.next_power_of_2(triton.cdiv(num_tiles, max_programs))
        num_programs = triton.cdiv(num_tiles, tiles)
    tile = block_t * max(block_t, block_e)
    num_warps = 1 if tile <= 1024 else 2 if tile <= 4096 else 4 if tile <= 8192 else 8
    return AlignPlan(block_t, tiles, num_programs, num_warps)


@triton.jit
def _chunk_histogram(topk_ids, start, num_entries, BLOCK_E: tl.constexpr,
                     BLOCK_T: tl.constexpr, TILES: tl.constexpr):
    """Entries per expert among the TILES * BLOCK_T entries from `start` (one-hot rows
    summed; lanes past the experts count nothing)."""
    offs_e = tl.arange(0, BLOCK_E)
    offs_t = tl.arange(0, BLOCK_T)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for tile in range(TILES):
        entries = start + tile * BLOCK_T + offs_t
        experts = tl.load(topk_ids + entries, mask=entries < num_entries, other=-1)
        counts += tl.sum((experts[:, None] == offs_e[None, :]).to(tl.int32), 0)
    return counts


@triton.jit
def _align_count_kernel(topk_ids, chunk_counts, num_entries, NUM_EXPERTS: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr):
    """Row `chunk` of the [programs, E] count table: the entries per expert of this program's
    TILES * BLOCK_T entries (plain stores: each program owns its row)."""
    chunk = tl.program_id(0)
    counts = _chunk_histogram(topk_ids, chunk * TILES * BLOCK_T, num_entries, BLOCK_E,
                              BLOCK_T, TILES)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(chunk_counts + chunk * NUM_EXPERTS + offs_e, counts, mask=offs_e < NUM_EXPERTS)


@triton.jit
def _align_scatter_kernel(topk_ids, chunk_counts, sorted_entries, block_experts, num_padded,
                          num_entries, max_padded, rows_per_program,
                          NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_T: tl.constexpr, TILES: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                          COUNT_HERE: tl.constexpr):
    """Program `chunk` stores the sorted rows of its TILES * BLOCK_T entries, the padding
    sentinels of the experts e with e % programs == chunk, and the tail sentinels and block
    experts of its `rows_per_program` rows. Entry rows and padding rows are disjoint, so the
    programs need no order among them. COUNT_HERE (one program): the counts come from the
    entries themselves, not from the count table."""
    chunk = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_e = tl.arange(0, BLOCK_E)
    is_expert = offs_e < NUM_EXPERTS
    first = chunk * TILES * BLOCK_T
    offs_t = tl.arange(0, BLOCK_T)
    # The first tile's experts, loaded before the counts so that the two loads overlap.
    experts = tl.load(topk_ids + first + offs_t, mask=first + offs_t < num_entries,
                      other=-1).to(tl.int32)
    if COUNT_HERE:
        counts = _chunk_histogram(topk_ids, 0, num_entries, BLOCK_E, BLOCK_T, TILES)
        before = tl.zeros([BLOCK_E], tl.int32)
    else:
        # Every expert's total, and its entries in the chunks before this one (a column sum
        # over the earlier rows of the count table).
        counts = tl.zeros([BLOCK_E], tl.int32)
        before = tl.zeros([BLOCK_E], tl.int32)
        offs_c = tl.arange(0, BLOCK_C)
        for c_start in range(0, num_programs, BLOCK_C):
            chunks = c_start + offs_c
            table = tl.load(chunk_counts + chunks[:, None] * NUM_EXPERTS + offs_e[None, :],
                            mask=(chunks < num_programs)[:, None] & is_expert[None, :], other=0)
            counts += tl.sum(table, 0)
            before += tl.sum(tl.where((chunks < chunk)[:, None], table, 0), 0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)

    # An entry's row: its expert's start, plus that expert's entries in earlier chunks and
    # earlier tiles (`seen`, gathered through the one-hot row), plus its rank in its tile
    # (the same expert's entries before it: a [BLOCK_T, BLOCK_T] comparison summed).
    earlier = offs_t[None, :] < offs_t[:, None]
    seen = starts + before
    for tile in range(TILES):
        entries = first + tile * BLOCK_T + offs_t
        onehot = experts[:, None] == offs_e[None, :]
        base = tl.sum(tl.where(onehot, seen[None, :], 0), 1)
        rank = tl.sum(((experts[:, None] == experts[None, :]) & earlier).to(tl.int32), 1)
        tl.store(sorted_entries + base + rank, entries, mask=entries < num_entries)
        if TILES > 1:
            seen += tl.sum(onehot.to(tl.int32), 0)
            following = entries + BLOCK_T
            experts = tl.load(topk_ids + following, mask=following < num_entries,
                              other=-1).to(tl.int32)

    # The padding rows closing this program's experts' runs (fewer than BLOCK_M each).
    offs_m = tl.arange(0, BLOCK_M)
    mine = is_expert & (offs_e % num_programs == chunk)
    tl.store(sorted_entries + (starts + counts)[:, None] + offs_m[None, :],
             tl.zeros([BLOCK_E, BLOCK_M], tl.int32) + num_entries,
             mask=mine[:, None] & (offs_m[None, :] < (padded - counts)[:, None]))
    if chunk == 0:
        tl.store(num_padded, total)

    # This program's share of the rows: sentinels past the total, and each block's expert
    # (the count of runs that end at or before it: NUM_EXPERTS for blocks past the total,
    # which are never read).
    row_start = chunk * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, max_padded)
    offs_r = tl.arange(0, BLOCK_R)
    for r_start in range(row_start, row_end, BLOCK_R):
        rows = r_start + offs_r
        tl.store(sorted_entries + rows, tl.zeros([BLOCK_R], tl.int32) + num_entries,
                 mask=(rows >= total) & (rows < row_end))
    offs_b = tl.arange(0, BLOCK_B)
    for b_start in range(row_start // BLOCK_M, row_end // BLOCK_M, BLOCK_B):
        blocks = b_start + offs_b
        owner = tl.sum(((ends[None, :] <= (blocks * BLOCK_M)[:, None])
                        & is_expert[None, :]).to(tl.int32), 1)
        tl.store(block_experts + blocks, owner, mask=blocks < row_end // BLOCK_M)


def _align_sizes(num_entries: int, num_experts: int, block_m: int,
                 plan: AlignPlan) -> tuple[int, int, dict]:
    """The host bound on the padded rows, the rows a program covers for the tail sentinels
    and block experts (whole blocks), and the scatter kernel's constants."""
    max_padded = num_entries + min(num_experts, num_entries) * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    rows_per_program = triton.cdiv(max_padded // block_m, plan.num_programs) * block_m
    block_e = triton.next_power_of_2(num_experts)
    constants = dict(
        NUM_EXPERTS=num_experts, BLOCK_E=block_e, BLOCK_T=plan.block_t, TILES=plan.tiles,
        BLOCK_C=max(1, min(triton.next_power_of_2(plan.num_programs), 8192 // block_e)),
        BLOCK_M=block_m, BLOCK_R=max(16, min(1024, triton.next_power_of_2(rows_per_program))),
        BLOCK_B=max(16, min(triton.next_power_of_2(max(rows_per_program // block_m, 1)),
                            8192 // block_e)),
        COUNT_HERE=plan.num_programs == 1)
    return max_padded, rows_per_program, constants


def align_entries_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                            plan: Optional[AlignPlan] = None) -> ExpertAlignment:
    """Sort the flattened `topk_ids` [T, k] entries by expert, each expert's run padded to a
    multiple of `block_m`, without reading anything back to the host. Every size here is a
    function of T, k, E and block_m (`plan`: `align_plan`'s, or a bench's alternative)."""
    num_entries = topk_ids.numel()
    plan = plan or align_plan(num_entries, num_experts)
    assert plan.num_programs * plan.tiles * plan.block_t >= num_entries
    max_padded, rows_per_program, constants = _align_sizes(num_entries, num_experts, block_m,
                                                           plan)
    device = topk_ids.device
    sorted_entries = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    topk_ids = topk_ids.reshape(-1)
    # The count table (a row a program), or any int32 tensor where one program counts alone.
    chunk_counts = num_padded
    if not constants["COUNT_HERE"]:
        chunk_counts = torch.empty(plan.num_programs, num_experts, dtype=torch.int32,
                                   device=device)
        _align_count_kernel[(plan.num_programs,)](
            topk_ids, chunk_counts, num_entries, NUM_EXPERTS=num_experts,
            BLOCK_E=constants["BLOCK_E"], BLOCK_T=plan.block_t, TILES=plan.tiles,
            num_warps=plan.num_warps)
    _align_scatter_kernel[(plan.num_programs,)](
        topk_ids, chunk_counts, sorted_entries, block_experts, num_padded, num_entries,
        max_padded, rows_per_program, **constants, num_warps=plan.num_warps)
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
                                                           K, fp8.block_k, K_UNIFORM), a_tile.dtype,
                                     "cast", True)
        acc = tl.dot(a_tile, w_tile, acc, input_precision=DOT_PRECISION)
        if GATED:
            up_tile = tl.load(w_ptrs + N * stride_w_n, mask=w_mask, other=0.0)
            if FP8_WEIGHT:
                up_tile = dequantize_tile(up_tile, weight_scales(scales, up_scale_rows, k_start,
                                                                 offs_k[:, None], K, fp8.block_k,
                                                                 K_UNIFORM), a_tile.dtype,
                                         "cast", True)
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
        K_UNIFORM=scale is not None and k_uniform(scale.block_k, w.shape[2], config.block_k),
        num_warps=config.num_warps, num_stages=config.num_stages)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  config: Optional[MoEConfig] = None, *, w13_scale: Optional[WeightScale] = None,
                  w2_scale: Optional[WeightScale] = None) -> torch.Tensor:
    """Routed experts' output [T, H] for x [T, H], w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I], topk_weights [T, k] (fp32) and topk_ids [T, k] (distinct experts a token).
    With scales, w13 and w2 are FP8 (both or neither; layers/fp8_weight.py, a grid per expert)."""
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
