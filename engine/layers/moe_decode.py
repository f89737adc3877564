"""Routed experts for decode-sized batches (M <= 16 tokens: a decode step's requests, or a
verify step's draft tokens) in Triton, reading each picked expert's weights once per step.

At small M a MoE layer is bound by the bytes of the experts the tokens picked. The grouped
kernel (`fused_moe_triton.fused_experts`) first sorts the (token, expert) entries by expert in
a one-program launch, then pads every expert's run to a 16-row block; here there is no sort:

- The grid is (entry slot, N tile) with M*k slots, fixed by the shapes (a CUDA graph captured
  at M replays any routing; nothing is read on the host). Slot s owns the expert of flattened
  entry s when that entry is the expert's first occurrence in `topk_ids`; a later slot of the
  same expert exits at once. So every distinct expert is handled by exactly one slot, which
  reads its weights once for all the tokens that picked it (the deduplication compares the
  <= M*k ids in-kernel: a few hundred bytes per program).
- `_gate_up_kernel`: the slot's expert's gate and up rows of one N tile times the hidden states
  of every token that picked it (16 token rows in one tl.dot; tokens that did not pick it are
  masked), silu(gate) * up stored at each picking entry's row (t*k + j) of `intermediate`.
- `_down_kernel`: the down projection of those rows, times the entry's top-k weight, stored at
  the same entry row; then every program counts its arrival on its N tile's counter (of the
  skinny GEMM's workspace) and the last to arrive sums the tile's k rows of each token in
  entry order (deterministic, unlike atomically adding experts into one output row; the
  grouped kernel's [M, k, H] sum, without its launch).

DeepSeek's shared experts need nothing here: they are the stacks' last slots and every token's
routing lists them with weight 1.0 (`moe.select_experts`' `num_shared`), so the first token's
entries own them, and they are read once and summed with the routed rows in the same combine.

Weights stay in their checkpoint layout: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from specserve.engine.layers.skinny_gemm import workspace_for
from specserve.engine.pdl import launch_options, release_dependents, wait_for_predecessor

MAX_DECODE_TOKENS = 16  # one tl.dot row block holds every token


class DecodeMoEConfig(NamedTuple):
    block_n: int     # output columns per program (gate/up: of I; down: of H)
    block_k: int
    num_warps: int
    num_stages: int


def default_decode_config(device: torch.device) -> DecodeMoEConfig:
    if torch.device(device).type != "cuda":  # the interpreter: few, wide programs run fastest
        return DecodeMoEConfig(block_n=64, block_k=64, num_warps=4, num_stages=1)
    # Narrow N tiles: at M = 1 only k experts are live, and their I/32 (gate/up) or H/32
    # (down) tiles must still fill every SM. `bench/moe_decode.py --sweep` (H200, M = 1, 54
    # configs a kernel at the DeepSeek-V2-Lite and Qwen3-30B-A3B shapes): the best of each
    # kernel is within 0-2 % of this one (docs/bench/moe_decode_sweep_h200.json).
    return DecodeMoEConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)


@triton.jit
def _slot_expert(topk_ids, slot, num_entries, BLOCK_ENTRIES: tl.constexpr):
    """(expert of entry `slot`, how many earlier entries picked it: 0 where the slot owns it)."""
    offs = tl.arange(0, BLOCK_ENTRIES)
    ids = tl.load(topk_ids + offs, mask=offs < num_entries, other=-1)
    expert = tl.load(topk_ids + slot)
    return expert, tl.sum(((ids == expert) & (offs < slot)).to(tl.int32), 0)


@triton.jit
def _token_entries(topk_ids, topk_weights, expert, num_tokens, TOP_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """For token rows 0..BLOCK_M: whether the token picked `expert`, the entry row (t*k + j)
    it picked it at, and that entry's top-k weight (0 where not picked)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_TOPK)
    in_range = (offs_m[:, None] < num_tokens) & (offs_j[None, :] < TOP_K)
    entry = offs_m[:, None] * TOP_K + offs_j[None, :]
    hit = (tl.load(topk_ids + entry, mask=in_range, other=-1) == expert) & in_range
    picked = tl.sum(hit.to(tl.int32), 1) > 0
    rows = offs_m * TOP_K + tl.sum(tl.where(hit, offs_j[None, :], 0), 1)
    weight = tl.sum(tl.where(hit, tl.load(topk_weights + entry, mask=in_range, other=0.0), 0.0), 1)
    return picked, rows, weight


@triton.jit
def _gate_up_kernel(x, w13, intermediate, topk_ids, topk_weights, num_tokens, num_entries, N, K,
                    stride_x, stride_we, stride_wn, stride_wk, stride_inter,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                    BLOCK_ENTRIES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)  # the router's ids (engine/pdl.py)
    slot = tl.program_id(0)
    expert, earlier = _slot_expert(topk_ids, slot, num_entries, BLOCK_ENTRIES)
    if earlier > 0:  # another slot reads this expert's weights
        return
    picked, rows, _ = _token_entries(topk_ids, topk_weights, expert, num_tokens, TOP_K, BLOCK_M,
                                     BLOCK_TOPK)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    x_ptrs = x + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = (w13 + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
              + offs_k[:, None] * stride_wk)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        a = tl.load(x_ptrs, mask=picked[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0), up,
                    input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    release_dependents(PDL)
    h = gate * tl.sigmoid(gate) * up
    tl.store(intermediate + rows[:, None].to(tl.int64) * stride_inter + offs_n[None, :],
             h.to(intermediate.dtype.element_ty), mask=picked[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(intermediate, w2, weighted, out, arrivals, topk_ids, topk_weights,
                 num_tokens, num_entries, N, K, stride_inter, stride_we, stride_wn, stride_wk,
                 stride_weighted, stride_out,
                 TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                 BLOCK_ENTRIES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)  # gate/up's intermediate rows (engine/pdl.py)
    slot = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    expert, earlier = _slot_expert(topk_ids, slot, num_entries, BLOCK_ENTRIES)
    if earlier == 0:  # else another slot reads this expert's weights
        picked, rows, weight = _token_entries(topk_ids, topk_weights, expert, num_tokens, TOP_K,
                                              BLOCK_M, BLOCK_TOPK)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = intermediate + rows[:, None].to(tl.int64) * stride_inter + offs_k[None, :]
        w_ptrs = (w2 + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
                  + offs_k[:, None] * stride_wk)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k_start in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k_start
            a = tl.load(a_ptrs, mask=picked[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a, tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0),
                         acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        acc = acc * weight.to(tl.float32)[:, None]
        tl.store(weighted + rows[:, None].to(tl.int64) * stride_weighted + offs_n[None, :],
                 acc.to(weighted.dtype.element_ty), mask=picked[:, None] & n_mask[None, :])
    release_dependents(PDL)
    # Every slot (those that skipped too) counts its arrival on the N tile's counter after its
    # stores (a CTA barrier, then the atomic's release); the last to arrive sums each token's
    # k entry rows from L2 in entry order (deterministic).
    tl.debug_barrier()
    counter = arrivals + tl.program_id(1)
    if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.debug_barrier()
        dtype = out.dtype.element_ty
        tile_mask = (offs_m < num_tokens)[:, None] & n_mask[None, :]
        m64 = offs_m.to(tl.int64)[:, None]
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j in tl.static_range(TOP_K):
            total += tl.load(weighted + (m64 * TOP_K + j) * stride_weighted + offs_n[None, :],
                             mask=tile_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        # torch's sum over k: fp32 sums, rounded once
        tl.store(out + m64 * stride_out + offs_n[None, :], total.to(dtype), mask=tile_mask)
        tl.store(counter, 0)  # ready for the next launch (and the next graph replay)


def decode_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         config: Optional[DecodeMoEConfig] = None,
                         down_config: Optional[DecodeMoEConfig] = None) -> torch.Tensor:
    """Routed experts' output [M, H] for x [M, H] (M <= MAX_DECODE_TOKENS), w13 [E, 2I, H],
    w2 [E, H, I], topk_weights [M, k] fp32 and topk_ids [M, k] (distinct experts a token):
    `fused_moe_triton.fused_experts`'s contract, for few tokens. `config` launches the gate/up
    kernel, `down_config` (default: `config`) the down kernel."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if num_tokens > MAX_DECODE_TOKENS:
        raise ValueError(f"decode_fused_experts: {num_tokens} tokens; at most {MAX_DECODE_TOKENS}")
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden size {hidden}")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} must both be [{num_tokens}, k]")
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    config = config or default_decode_config(x.device)
    down_config = down_config or config
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    num_entries = num_tokens * top_k
    meta = dict(TOP_K=top_k, BLOCK_M=MAX_DECODE_TOKENS, BLOCK_TOPK=triton.next_power_of_2(top_k),
                BLOCK_ENTRIES=triton.next_power_of_2(num_entries),
                # fp32 operands would run as TF32 on tensor cores; keep an fp32 engine exact.
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                **launch_options(x.device))
    intermediate = x.new_empty(num_entries, inter)
    _gate_up_kernel[(num_entries, triton.cdiv(inter, config.block_n))](
        x, w13, intermediate, topk_ids, topk_weights, num_tokens, num_entries, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), intermediate.stride(0),
        **_tiles(config), **meta)
    weighted = x.new_empty(num_entries, hidden)
    out = x.new_empty(num_tokens, hidden)
    n_tiles = triton.cdiv(hidden, down_config.block_n)
    # The combine's counters, one an N tile (zero between launches, which run in stream order).
    arrivals = workspace_for(x.device).arrivals
    assert n_tiles <= arrivals.numel()
    _down_kernel[(num_entries, n_tiles)](
        intermediate, w2, weighted, out, arrivals, topk_ids, topk_weights, num_tokens,
        num_entries, hidden, inter, intermediate.stride(0), w2.stride(0), w2.stride(1),
        w2.stride(2), weighted.stride(0), out.stride(0), **_tiles(down_config), **meta)
    return out


def _tiles(config: DecodeMoEConfig) -> dict:
    return dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
                num_stages=config.num_stages)
