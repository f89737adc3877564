"""Softmax top-k routing in one Triton launch (CUDA; the interpreter runs it in tests).

`select_experts`' softmax mode without groups (DeepSeek-V2's greedy routing, Qwen3-MoE,
Mixtral) is, in torch, a softmax, a top-k, a sum and a division for the renormalisation and a
multiplication by the routed scaling factor: five launches per MoE layer, each a few
microseconds of a decode step that reads a few hundred microseconds of weights. Here one
program per token does all of it on the token's [E] fp32 logits in registers: the softmax
(exp(l - max) / sum, torch's formula), k rounds of argmax (the lowest index among equal
probabilities), the renormalisation over the k and the scaling.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(logits, weights, ids, num_experts, stride_logits, scaling,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    row = tl.load(logits + token * stride_logits + offs_e, mask=offs_e < num_experts,
                  other=float("-inf")).to(tl.float32)
    exp = tl.exp(row - tl.max(row, 0))
    probs = exp / tl.sum(exp, 0)  # padding experts: exp(-inf) = 0
    probs = tl.where(offs_e < num_experts, probs, -1.0)  # never picked (probabilities are >= 0)
    chosen_p = tl.zeros([BLOCK_K], tl.float32)
    chosen_e = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        expert = tl.min(tl.where(probs == best, offs_e, BLOCK_E), 0)
        chosen_p = tl.where(offs_k == j, best, chosen_p)
        chosen_e = tl.where(offs_k == j, expert, chosen_e)
        probs = tl.where(offs_e == expert, -1.0, probs)
    if RENORMALIZE:
        chosen_p = chosen_p / tl.sum(chosen_p, 0)  # the unused BLOCK_K lanes hold 0
    tl.store(weights + token * TOP_K + offs_k, chosen_p * scaling, mask=offs_k < TOP_K)
    tl.store(ids + token * TOP_K + offs_k, chosen_e.to(tl.int64), mask=offs_k < TOP_K)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) from fp32 logits [T, E]: softmax over the
    E experts, the k largest probabilities (largest first), divided by their sum when
    `renormalize`, times `scaling`."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"softmax_topk: top_k {top_k} does not fit {num_experts} experts")
    assert router_logits.stride(1) == 1
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        _softmax_topk_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), scaling,
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=1 if block_e <= 128 else 2)
    return weights, ids
