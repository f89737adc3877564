"""Mixture of experts: routing and the routed experts' computation.

Routing reproduces transformers exactly, in fp32: DeepSeek-V2 (softmax scores, greedy or
group-limited by each group's best score), V3 (sigmoid scores; the correction bias steers which
experts are chosen, not their weights; groups ranked by the sum of their two best), and
Qwen3-MoE / Mixtral (softmax over all experts, top-k, renormalised over the k when
norm_topk_prob; Mixtral always renormalises).

Expert weights are stacked: `w13[e]` is expert e's gate rows then up rows ([E, 2I, H]),
`w2[e]` its down projection ([E, H, I]). `fused_experts` here is the torch computation (the
CPU path and reference); on CUDA `run_experts` dispatches to the Triton kernel of the same
signature and layout (`fused_moe_triton.fused_experts`) when it is importable, and for at most
16 tokens with 16-bit experts to the decode kernel (`moe_decode.decode_fused_experts`: each
picked expert's weights read once, no sort launch).

DeepSeek's shared experts are the stacks' last S slots (its shared MLP's intermediate units cut
into S experts of the routed size: an MLP's output is a sum over its units), and routing with
`num_shared` appends them to every token's entries with weight 1.0 (unscaled), so every
experts path above runs routed and shared experts together: at decode one gate/up and one
down launch a MoE layer, and with tensor parallelism one all-reduce.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from specserve.engine.layers.fp8_weight import WeightScale, dequantize

_triton_fused_experts = _decode_fused_experts = _softmax_topk = _router_softmax_topk = None
MAX_DECODE_TOKENS = MAX_ROUTER_TOKENS = 0  # the decode kernels' bounds, set where they import
if torch.cuda.is_available():
    try:
        from specserve.engine.layers.fused_moe_triton import fused_experts as _triton_fused_experts
        from specserve.engine.layers.moe_decode import MAX_DECODE_TOKENS
        from specserve.engine.layers.moe_decode import decode_fused_experts as _decode_fused_experts
        from specserve.engine.layers.moe_router import MAX_ROUTER_TOKENS
        from specserve.engine.layers.moe_router import router_softmax_topk as _router_softmax_topk
        from specserve.engine.layers.moe_router import softmax_topk as _softmax_topk
    except ImportError:  # no triton (or no kernel yet): the torch loops run on the GPU too
        _triton_fused_experts = _decode_fused_experts = _softmax_topk = _router_softmax_topk = None


def select_experts(router_logits: torch.Tensor, *, top_k: int, scoring: str, num_groups: int = 1,
                   topk_groups: int = 1, norm_topk_prob: bool = False,
                   routed_scaling_factor: float = 1.0, correction_bias: Optional[torch.Tensor] = None,
                   num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k + S] fp32, expert ids [T, k + S] int64) from fp32 router logits [T, E]:
    the k routed entries, then the S = `num_shared` shared slots (ids E.., weight 1.0; the
    routed scaling factor scales only the routed weights, as DeepSeek does).

    softmax (V2, Qwen3-MoE, Mixtral): group-limited when num_groups > 1 (a group ranks by its
    best expert; the experts outside the best topk_groups groups score 0); norm_topk_prob
    divides the k probabilities by their sum (no epsilon, as transformers' Qwen3-MoE and
    Mixtral: softmax probabilities are positive). sigmoid (V3): the choice ranks
    scores + correction_bias, groups by the sum of their two best, the weights are the
    unbiased scores (renormalised over the k when norm_topk_prob).

    On CUDA, softmax routing without groups is one Triton launch (`moe_router.softmax_topk`,
    the same values up to the last bits of the softmax)."""
    num_tokens, num_experts = router_logits.shape
    per_group = num_experts // num_groups
    if scoring == "softmax" and num_groups == 1 and router_logits.is_cuda and _softmax_topk is not None:
        return _softmax_topk(router_logits, top_k, norm_topk_prob, routed_scaling_factor, num_shared)
    if scoring == "softmax":
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
        if num_groups > 1:
            group_scores = scores.view(num_tokens, num_groups, per_group).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(group_scores, topk_groups, per_group), 0.0)
        weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif scoring == "sigmoid":
        scores = router_logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        group_scores = choice.view(num_tokens, num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(group_scores, topk_groups, per_group), float("-inf"))
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"scoring_func: unsupported {scoring!r} (softmax and sigmoid are)")
    weights = weights * routed_scaling_factor
    if num_shared:
        shared = torch.arange(num_experts, num_experts + num_shared, device=ids.device)
        weights = torch.cat([weights, weights.new_ones(num_tokens, num_shared)], dim=1)
        ids = torch.cat([ids, shared.expand(num_tokens, num_shared)], dim=1)
    return weights, ids


def can_fuse_router(x: torch.Tensor, scoring: str, num_groups: int) -> bool:
    """Whether `route` computes the logits and the routing in one launch: CUDA, softmax
    routing without groups, a decode-sized batch."""
    return (_router_softmax_topk is not None and x.is_cuda and scoring == "softmax"
            and num_groups == 1 and 1 <= x.shape[0] <= MAX_ROUTER_TOKENS)


def route(x: torch.Tensor, router_weight: torch.Tensor, *, top_k: int, scoring: str,
          num_groups: int = 1, topk_groups: int = 1, norm_topk_prob: bool = False,
          routed_scaling_factor: float = 1.0, correction_bias: Optional[torch.Tensor] = None,
          num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` of the fp32 router logits F.linear(x.float(), router_weight); where
    `can_fuse_router`, the logits' gemv and the routing are one Triton launch
    (`moe_router.router_softmax_topk`: the same routing up to the last bits of the sums)."""
    if can_fuse_router(x, scoring, num_groups):
        return _router_softmax_topk(x, router_weight, top_k, norm_topk_prob, routed_scaling_factor,
                                    num_shared)
    return select_experts(F.linear(x.float(), router_weight), top_k=top_k, scoring=scoring,
                          num_groups=num_groups, topk_groups=topk_groups,
                          norm_topk_prob=norm_topk_prob,
                          routed_scaling_factor=routed_scaling_factor,
                          correction_bias=correction_bias, num_shared=num_shared)


def _group_mask(group_scores: torch.Tensor, topk_groups: int, per_group: int) -> torch.Tensor:
    """[T, E] bool: the expert is in one of the token's best topk_groups groups."""
    best = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return chosen.repeat_interleave(per_group, dim=1)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: Optional[WeightScale] = None,
                  w2_scale: Optional[WeightScale] = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with SwiGLU experts; x: [T, H].
    With scales the stacked weights are FP8 (layers/fp8_weight.py), dequantised per expert.

    Experts run one after another over their tokens and add in ascending expert order, as
    transformers does, so fp32 results match it bit for bit. The per-expert token counts are
    read on the host (not capturable in a CUDA graph: graphs use the Triton kernel)."""
    out = torch.zeros_like(x)
    num_experts, k = w13.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        picks = order[start:start + n]
        start += n
        tokens = picks // k
        gate, up = F.linear(x[tokens], _expert(w13, w13_scale, e, x.dtype)).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, _expert(w2, w2_scale, e, x.dtype))
        out.index_add_(0, tokens, (h * topk_weights.reshape(-1)[picks, None]).to(x.dtype))
    return out


def _expert(w: torch.Tensor, scale: Optional[WeightScale], e: int, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[e]
    return dequantize(w[e], scale._replace(values=scale.values[e]), dtype)


def experts_capturable() -> bool:
    """Whether routed experts can run inside a CUDA graph (the Triton kernel reads no host
    counts; the torch loop does)."""
    return _triton_fused_experts is not None


def run_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, w13_scale: Optional[WeightScale] = None,
                w2_scale: Optional[WeightScale] = None) -> torch.Tensor:
    """The Triton kernels on CUDA when available (decode-sized 16-bit batches: the decode
    kernel; else the grouped one, which also takes FP8 scales), else the torch loop."""
    if x.is_cuda and _triton_fused_experts is not None:
        if w13_scale is None and x.shape[0] <= MAX_DECODE_TOKENS:
            return _decode_fused_experts(x, w13, w2, topk_weights, topk_ids)
        return _triton_fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                                     w2_scale=w2_scale)
    return fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
