"""The decode MoE kernel (`layers/moe_decode.py`) against the torch path (`layers/moe.py`) in
fp32: in the interpreter on the CPU (tiny shapes) and, marked `gpu`, at Qwen3-30B-A3B and
DeepSeek-V2-Lite shapes in bf16 and under CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_fused_moe import random_moe, reference_experts  # noqa: E402

from specserve.engine.layers.moe_decode import (  # noqa: E402
    MAX_DECODE_TOKENS, DecodeMoEConfig, decode_fused_experts)

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


# ---------------------------------------------------------------------------------------------
# Real shapes on a GPU (bf16, default config)
# ---------------------------------------------------------------------------------------------
GPU_SHAPES = {"qwen3_30b_a3b": (128, 8, 2048, 768), "v2_lite": (64, 6, 2048, 1408)}


@pytest.fixture(scope="module", params=list(GPU_SHAPES))
def gpu_weights(request):
    num_experts, top_k, hidden, inter = GPU_SHAPES[request.param]
    gen = torch.Generator(device="cuda").manual_seed(5)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda",
                      dtype=torch.bfloat16) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device="cuda",
                     dtype=torch.bfloat16) * inter ** -0.5
    return top_k, w13, w2


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
