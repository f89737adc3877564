"""Softmax top-k routing in one Triton launch (CUDA; the interpreter runs it in tests).

`select_experts`' softmax mode without groups (DeepSeek-V2's greedy routing, Qwen3-MoE,
Mixtral) is, in torch, a softmax, a top-k, a sum and a division for the renormalisation and a
multiplication by the routed scaling factor: five launches per MoE layer, each a few
microseconds of a decode step that reads a few hundred microseconds of weights. Here one
program per token does all of it on the token's [E] fp32 logits in registers: the softmax
(exp(l - max) / sum, torch's formula), k rounds of argmax (the lowest index among equal
probabilities), the renormalisation over the k and the scaling.

With `num_shared` (DeepSeek's shared experts, stored as the expert stack's last slots) each
token's row also gets that many constant entries after its k: expert ids E, E+1, ... with
weight 1.0, neither renormalised nor scaled (DeepSeek scales the routed weights only), so the
expert kernels run the shared experts as slots every token picked.

For decode-sized batches (`MAX_ROUTER_TOKENS`) `router_softmax_topk` also computes the logits
in the same launch: the fp32 router's x.float() cast and cuBLAS's gemv (two kernels, a dot and
a one-block reduce) were three more launches a layer. Its programs (one warp at up to 4
tokens) each take an expert's weight row (a few past 128 experts) over the whole hidden size (fp32 products and
sums, as F.linear on x.float()), store the logits, and count their arrival on a counter of the
skinny GEMM's workspace; the last to arrive routes every token (the skinny GEMM's split-K
pattern: no second launch, no host sync).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.engine.layers.skinny_gemm import workspace_for
from specserve.engine.pdl import launch_options, release_dependents, wait_for_predecessor

MAX_ROUTER_TOKENS = 16  # the fused router's rows (a decode or verify step); above: the gemv


@triton.jit
def _route_rows(logits, offs_e, num_experts, scaling, TOP_K: tl.constexpr,
                NUM_SHARED: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """(weights, ids) [rows, BLOCK_K] of fp32 logits [rows, BLOCK_E] (padding: -inf): the k
    routed entries, then the NUM_SHARED shared slots (ids E.., weight 1.0).

    Each of the k rounds is one max over a key per expert: the probability's bits (a
    non-negative float orders as its bits do) above the reversed index, so the largest key is
    the largest probability at its lowest index, with one reduction instead of a max and then
    a min among the ties (the reductions are the serial part of the router's last program)."""
    exp = tl.exp(logits - tl.max(logits, 1)[:, None])
    probs = exp / tl.sum(exp, 1)[:, None]  # padding experts: exp(-inf) = 0
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = bits * BLOCK_E + (BLOCK_E - 1 - offs_e[None, :])
    keys = tl.where(offs_e[None, :] < num_experts, keys, -1)  # never picked (keys >= 0)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    chosen_p = tl.zeros([logits.shape[0], BLOCK_K], tl.float32)
    chosen_e = tl.zeros([logits.shape[0], BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, 1)[:, None]
        expert = BLOCK_E - 1 - best % BLOCK_E
        best_p = (best // BLOCK_E).to(tl.int32).to(tl.float32, bitcast=True)
        chosen_p = tl.where(offs_k == j, best_p, chosen_p)
        chosen_e = tl.where(offs_k == j, expert, chosen_e)
        keys = tl.where(keys == best, -1, keys)
    if RENORMALIZE:
        chosen_p = chosen_p / tl.sum(chosen_p, 1)[:, None]  # the unused BLOCK_K lanes hold 0
    shared = (offs_k >= TOP_K) & (offs_k < TOP_K + NUM_SHARED)
    return (tl.where(shared, 1.0, chosen_p * scaling),
            tl.where(shared, num_experts + offs_k - TOP_K, chosen_e))


@triton.jit
def _softmax_topk_kernel(logits, weights, ids, num_experts, stride_logits, scaling,
                         TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    row = tl.load(logits + token * stride_logits + offs_e[None, :],
                  mask=offs_e[None, :] < num_experts, other=float("-inf")).to(tl.float32)
    chosen_p, chosen_e = _route_rows(row, offs_e, num_experts, scaling, TOP_K, NUM_SHARED,
                                     RENORMALIZE, BLOCK_E, BLOCK_K)
    width: tl.constexpr = TOP_K + NUM_SHARED
    tl.store(weights + token * width + offs_k, chosen_p, mask=offs_k < width)
    tl.store(ids + token * width + offs_k, chosen_e, mask=offs_k < width)


@triton.jit
def _router_kernel(x, w, logits, weights, ids, arrivals, M, num_experts, K, stride_xm,
                   stride_wn, scaling, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr,
                   RENORMALIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, EXPERTS_PER_PROGRAM: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    release_dependents(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_e = tl.program_id(0) * EXPERTS_PER_PROGRAM + tl.arange(0, EXPERTS_PER_PROGRAM)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    e_mask = offs_e < num_experts
    x_ptrs = x + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w + offs_e[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # Products summed per lane, reduced over K once after the loop.
    acc = tl.zeros([BLOCK_M, EXPERTS_PER_PROGRAM, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        x_tile = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_ptrs + k, mask=e_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x_tile.to(tl.float32)[:, None, :] * w_tile.to(tl.float32)[None, :, :]
    logit_ptrs = logits + offs_m[:, None] * num_experts + offs_e[None, :]
    tl.store(logit_ptrs, tl.sum(acc, 2), mask=m_mask[:, None] & e_mask[None, :])
    # Every thread's logit stores come before the arrival (a CTA barrier, then the atomic's
    # release); the last program reads the others' after its acquire, from L2.
    tl.debug_barrier()
    if tl.atomic_add(arrivals, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.debug_barrier()
        all_e = tl.arange(0, BLOCK_E)
        e_valid = (all_e < num_experts)[None, :]
        row = tl.load(logits + offs_m[:, None] * num_experts + all_e[None, :],
                      mask=m_mask[:, None] & e_valid, other=0.0, cache_modifier=".cg")
        row = tl.where(e_valid, row, float("-inf"))  # padding rows stay finite (not stored)
        chosen_p, chosen_e = _route_rows(row, all_e, num_experts, scaling, TOP_K, NUM_SHARED,
                                         RENORMALIZE, BLOCK_E, BLOCK_TOPK)
        width: tl.constexpr = TOP_K + NUM_SHARED
        offs_j = tl.arange(0, BLOCK_TOPK)[None, :]
        out_mask = m_mask[:, None] & (offs_j < width)
        tl.store(weights + offs_m[:, None] * width + offs_j, chosen_p, mask=out_mask)
        tl.store(ids + offs_m[:, None] * width + offs_j, chosen_e, mask=out_mask)
        tl.store(arrivals, 0)  # ready for the next launch (and the next graph replay)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 scaling: float = 1.0, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k + S] fp32, expert ids [T, k + S] int64) from fp32 logits [T, E]: softmax
    over the E experts, the k largest probabilities (largest first), divided by their sum when
    `renormalize`, times `scaling`; then the S = `num_shared` shared slots E.. with weight 1."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"softmax_topk: top_k {top_k} does not fit {num_experts} experts")
    assert router_logits.stride(1) == 1
    width = top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        _softmax_topk_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), scaling,
            TOP_K=top_k, NUM_SHARED=num_shared, RENORMALIZE=renormalize, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(width), num_warps=1 if block_e <= 128 else 2)
    return weights, ids


def router_softmax_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                        scaling: float = 1.0, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk(F.linear(x.float(), weight), ...)` in one launch for x [M, H] (any float
    dtype; 1 <= M <= MAX_ROUTER_TOKENS) and the router's weight [E, H] (fp32 as the model
    holds it, or any float dtype): the logits in fp32 from x's and the weight's values."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"router_softmax_topk: top_k {top_k} does not fit {num_experts} experts")
    assert 1 <= num_tokens <= MAX_ROUTER_TOKENS, f"router_softmax_topk: {num_tokens} rows"
    assert weight.shape[1] == hidden and weight.is_contiguous() and x.stride(1) == 1
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    weights = torch.empty(num_tokens, top_k + num_shared, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k + num_shared, dtype=torch.int64, device=x.device)
    # An expert's row a program up to 128 experts (about a program an SM): a decode step's
    # router is a read of E x H fp32 weights (1 MiB for Qwen3-30B-A3B), too much for one SM's
    # latency. The last program's softmax and k rounds of top-k are a chain of reductions over
    # the experts: within one warp each is a few shuffles, across warps also a shared-memory
    # round trip and barriers (the sm_90 PTX of four-warp programs at M = 1 has 43 bar.sync,
    # of one warp 6; four warps took 5.4 us a layer at Qwen3-30B-A3B's shape). So one warp up
    # to 4 tokens; above, four (one warp would spill holding the [M, E] routing tile; with
    # several rows the rows spread over the warps). About 64 products a thread a K step: at
    # M = 1 a 2048-wide row in one step, every load in flight at once.
    per_program = triton.next_power_of_2(max(1, num_experts // 128))
    block_m = triton.next_power_of_2(num_tokens)
    num_warps = 1 if block_m <= 4 else 4
    block_k = min(triton.next_power_of_2(hidden),
                  max(16, 2048 * num_warps // (block_m * per_program)))
    _router_kernel[(triton.cdiv(num_experts, per_program),)](
        x, weight, logits, weights, ids, workspace_for(x.device).arrivals, num_tokens,
        num_experts, hidden, x.stride(0), weight.stride(0), scaling, TOP_K=top_k,
        NUM_SHARED=num_shared, RENORMALIZE=renormalize, BLOCK_M=block_m, EXPERTS_PER_PROGRAM=per_program,
        BLOCK_K=block_k, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_TOPK=triton.next_power_of_2(top_k + num_shared), num_warps=num_warps,
        **launch_options(x.device))
    return weights, ids
