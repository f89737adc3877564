"""The decode MoE kernels against the torch path (`layers/moe.py`) in fp32: the experts
(`layers/moe_decode.py`) and the softmax top-k router (`layers/moe_router.py`), in the
interpreter on the CPU (tiny shapes) and, marked `gpu`, at Qwen3-30B-A3B and DeepSeek-V2-Lite
shapes in bf16 and under CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_fused_moe import random_gpu_experts, random_moe, reference_experts  # noqa: E402

from specserve.engine.layers.moe import select_experts  # noqa: E402
from specserve.engine.layers.moe_decode import (  # noqa: E402
    MAX_DECODE_TOKENS, DecodeMoEConfig, decode_fused_experts)
from specserve.engine.layers.moe_router import softmax_topk  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# N/K tiles smaller than the tiny dims (hidden 40, intermediate 24) so loops and tails run.
SMALL = DecodeMoEConfig(block_n=16, block_k=16, num_warps=4, num_stages=1)


def check(x, w13, w2, topk_weights, topk_ids, config=SMALL):
    out = decode_fused_experts(x, w13, w2, topk_weights, topk_ids, config)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, reference_experts(x, w13, w2, topk_weights, topk_ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (1, 8, 1), (5, 8, 3), (16, 6, 2)])
def test_matches_reference(num_tokens, num_experts, top_k):
    """Random routing: at 16 tokens over 6 experts most experts serve several tokens (and
    one slot reads each); some experts may be picked by none."""
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    check(*random_moe(num_tokens, num_experts, top_k, 40, 24, gen))


def test_every_token_on_the_same_experts_and_empty_experts():
    """All 16 tokens pick experts 5 then 2 (two live slots of 32; six experts unused), int32
    ids; then top-1 on expert 5 alone."""
    gen = torch.Generator().manual_seed(1)
    x, w13, w2, topk_weights, _ = random_moe(16, 8, 2, 40, 24, gen)
    ids = torch.tensor([[5, 2]] * 16, device=DEVICE)
    check(x, w13, w2, topk_weights, ids.to(torch.int32))
    check(x, w13, w2, torch.ones(16, 1, device=DEVICE), ids[:, :1].contiguous())  # top-1: one slot


def test_default_config_and_rejections():
    gen = torch.Generator().manual_seed(2)
    x, w13, w2, topk_weights, topk_ids = random_moe(3, 8, 2, 32, 16, gen)
    check(x, w13, w2, topk_weights, topk_ids, config=None)
    with pytest.raises(ValueError, match="w2"):
        decode_fused_experts(x, w13, w2[:, :, :8], topk_weights, topk_ids)
    with pytest.raises(ValueError, match="at most 16"):
        decode_fused_experts(*random_moe(MAX_DECODE_TOKENS + 1, 4, 2, 32, 16, gen))
    assert decode_fused_experts(*random_moe(0, 4, 2, 32, 16, gen)).shape == (0, 32)


def assert_same_routing(got, expected):
    """Same experts per token (in any order) with the same weights."""
    (weights, ids), (ref_weights, ref_ids) = got, expected
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values.cpu(), ref_order.values.cpu())
    torch.testing.assert_close(weights.gather(1, order.indices).cpu(),
                               ref_weights.gather(1, ref_order.indices).cpu(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize,scaling", [
    (1, 4, 1, False, 1.0), (5, 60, 6, False, 1.5), (16, 128, 8, True, 1.0), (3, 8, 2, True, 2.0)])
def test_softmax_topk_matches_select_experts(num_tokens, num_experts, top_k, renormalize, scaling):
    """60 experts: a non-power-of-two count (padded lanes are never picked)."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 3
    weights, ids = softmax_topk(logits.to(DEVICE), top_k, renormalize, scaling)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert (weights[:, :-1] >= weights[:, 1:]).all()  # largest first
    expected = select_experts(logits, top_k=top_k, scoring="softmax", norm_topk_prob=renormalize,
                              routed_scaling_factor=scaling)  # CPU: the torch path
    assert_same_routing((weights, ids), expected)


def test_softmax_topk_edges():
    assert softmax_topk(torch.zeros(0, 8, device=DEVICE), 2, True)[1].shape == (0, 2)
    with pytest.raises(ValueError, match="top_k 9"):
        softmax_topk(torch.zeros(2, 8, device=DEVICE), 9, True)


# ---------------------------------------------------------------------------------------------
# Real shapes on a GPU (bf16, default config)
# ---------------------------------------------------------------------------------------------
GPU_SHAPES = {"qwen3_30b_a3b": (128, 8, 2048, 768), "v2_lite": (64, 6, 2048, 1408)}


@pytest.fixture(scope="module", params=list(GPU_SHAPES))
def gpu_weights(request):
    num_experts, top_k, hidden, inter = GPU_SHAPES[request.param]
    return (top_k, *random_gpu_experts(num_experts, hidden, inter))


def gpu_routing(num_tokens, num_experts, top_k, hidden, seed, concentrated=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    scores = torch.rand(num_tokens, num_experts, generator=gen, device="cuda")
    if concentrated:  # every token prefers the same few experts (shared picks)
        scores[:, :top_k] += 1
    topk_ids = scores.topk(top_k, dim=1).indices
    topk_weights = torch.rand(num_tokens, top_k, generator=gen, device="cuda").softmax(-1)
    return x, topk_weights, topk_ids


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
@pytest.mark.parametrize("concentrated", [False, True])
def test_real_shapes_bf16_gpu(gpu_weights, num_tokens, concentrated):
    top_k, w13, w2 = gpu_weights
    x, topk_weights, topk_ids = gpu_routing(num_tokens, w13.shape[0], top_k, w13.shape[2], 6, concentrated)
    out = decode_fused_experts(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference_experts(x, w13, w2, topk_weights, topk_ids),
                               atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_cuda_graph_replays_any_routing_without_sync_gpu(gpu_weights):
    """Captured at M = 16, replays follow new routings (spread and concentrated), and an
    eager call never waits on the device; run_experts dispatches here at M <= 16."""
    from specserve.engine.layers.moe import run_experts

    top_k, w13, w2 = gpu_weights
    num_experts, hidden = w13.shape[0], w13.shape[2]
    x, topk_weights, topk_ids = gpu_routing(16, num_experts, top_k, hidden, 7)
    decode_fused_experts(x, w13, w2, topk_weights, topk_ids)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = run_experts(x, w13, w2, topk_weights, topk_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(eager, decode_fused_experts(x, w13, w2, topk_weights, topk_ids))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_fused_experts(x, w13, w2, topk_weights, topk_ids)
    for seed, concentrated in ((8, False), (9, True)):
        new_x, new_weights, new_ids = gpu_routing(16, num_experts, top_k, hidden, seed, concentrated)
        x.copy_(new_x)
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, decode_fused_experts(x, w13, w2, topk_weights, topk_ids),
                                   atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
@pytest.mark.parametrize("shape,renormalize", [("qwen3_30b_a3b", True), ("v2_lite", False)])
def test_router_on_cuda_matches_the_torch_path_gpu(num_tokens, shape, renormalize):
    """select_experts on CUDA (the Triton router) routes as the torch path does on the CPU."""
    num_experts, top_k, _, _ = GPU_SHAPES[shape]
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(3))
    kwargs = dict(top_k=top_k, scoring="softmax", norm_topk_prob=renormalize)
    assert_same_routing(select_experts(logits.cuda(), **kwargs), select_experts(logits, **kwargs))
