"""The fused MoE Triton kernels against the torch path (`layers/moe.py`, in fp32): in the
interpreter on the CPU (tiny shapes, fp32) and, marked `gpu`, at DeepSeek shapes in bf16."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specserve.engine.layers.fused_moe_triton import (  # noqa: E402
    MoEConfig, align_entries_by_expert, fused_experts)
from specserve.engine.layers.moe import fused_experts as torch_fused_experts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# 16-entry row blocks, and N/K tiles smaller than the tiny dims so the loops and their masked
# tails run (tl.dot takes 16 at least on a GPU).
SMALL = MoEConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)


def reference_experts(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The torch path (`layers/moe.py`, exact against transformers) in fp32."""
    return torch_fused_experts(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)


def random_moe(num_tokens, num_experts, top_k, hidden, inter, gen, dtype=torch.float32,
               device=DEVICE):
    """Inputs, expert weights and a router's output: distinct experts per token, fp32 weights."""
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    x = randn(num_tokens, hidden)
    w13 = randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w2 = randn(num_experts, hidden, inter, scale=inter ** -0.5)
    topk_ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=1).indices
    topk_weights = torch.rand(num_tokens, top_k, generator=gen).softmax(-1)
    return x, w13, w2, topk_weights.to(device), topk_ids.to(device)


@pytest.mark.parametrize("num_tokens", [1, 3, 20, 150])  # 150: entries span several tiles
@pytest.mark.parametrize("num_experts,top_k", [(4, 2), (8, 3)])
def test_align_entries_by_expert(num_tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(0)
    topk_ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, 1).indices
    block_m = 4
    alignment = align_entries_by_expert(topk_ids.to(DEVICE), num_experts, block_m)
    sorted_entries = alignment.sorted_entries.cpu()
    flat = topk_ids.reshape(-1)
    num_entries = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(alignment.num_padded) == int(padded.sum())
    start = 0
    for expert in range(num_experts):
        run = sorted_entries[start:start + padded[expert]]
        # The expert's entries in their original order, then padding sentinels.
        assert run[:counts[expert]].tolist() == (flat == expert).nonzero().flatten().tolist()
        assert (run[counts[expert]:] == num_entries).all()
        blocks = alignment.block_experts[start // block_m:(start + padded[expert]) // block_m]
        assert (blocks.cpu() == expert).all()
        start += int(padded[expert])
    assert (sorted_entries[start:] == num_entries).all()


@pytest.mark.parametrize("num_tokens", [1, 5, 24])
@pytest.mark.parametrize("num_experts,top_k", [(4, 2), (6, 2)])
def test_fused_experts_matches_reference(num_tokens, num_experts, top_k):
    """hidden 40 and intermediate 24: neither a multiple of the 16-wide tiles."""
    gen = torch.Generator().manual_seed(1)
    x, w13, w2, topk_weights, topk_ids = random_moe(num_tokens, num_experts, top_k, 40, 24, gen)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, SMALL)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, reference_experts(x, w13, w2, topk_weights, topk_ids),
                               atol=1e-5, rtol=1e-5)


def test_fused_experts_default_config_and_int32_ids():
    gen = torch.Generator().manual_seed(2)
    x, w13, w2, topk_weights, topk_ids = random_moe(7, 8, 2, 32, 16, gen)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids.to(torch.int32))
    torch.testing.assert_close(out, reference_experts(x, w13, w2, topk_weights, topk_ids),
                               atol=1e-5, rtol=1e-5)


def test_fused_experts_rejects_mismatched_shapes():
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, topk_weights, topk_ids = random_moe(2, 4, 2, 32, 16, gen)
    with pytest.raises(ValueError, match="w2"):
        fused_experts(x, w13, w2[:, :, :8], topk_weights, topk_ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_experts(x, w13, w2, topk_weights[:, :1], topk_ids)


def test_fused_experts_empty_batch():
    gen = torch.Generator().manual_seed(4)
    x, w13, w2, topk_weights, topk_ids = random_moe(0, 4, 2, 32, 16, gen)
    assert fused_experts(x, w13, w2, topk_weights, topk_ids).shape == (0, 32)


# ---------------------------------------------------------------------------------------------
# DeepSeek shapes on a GPU (bf16, default configs)
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = {
    # experts, top-k, hidden, intermediate
    "v2_lite": (64, 6, 2048, 1408),
    # V3's 256 experts top-8 and intermediate 2048, hidden scaled from 7168 to 2048 (the
    # weights are 6.4 GB instead of 22.5 GB).
    "v3": (256, 8, 2048, 2048),
}


def random_gpu_experts(num_experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded bf16 expert stacks w13 [E, 2I, H] and w2 [E, H, I] on the GPU, unit-scale outputs."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda",
                      dtype=torch.bfloat16) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device="cuda",
                     dtype=torch.bfloat16) * inter ** -0.5
    return w13, w2


@pytest.fixture(scope="module", params=list(GPU_SHAPES))
def gpu_moe_weights(request):
    num_experts, top_k, hidden, inter = GPU_SHAPES[request.param]
    w13, w2 = random_gpu_experts(num_experts, hidden, inter)
    return top_k, w13, w2, (w13.float(), w2.float())  # the reference's fp32 copies


def gpu_routing(num_tokens, num_experts, top_k, hidden, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    scores = torch.rand(num_tokens, num_experts, generator=gen, device="cuda")
    topk_ids = scores.topk(top_k, dim=1).indices
    topk_weights = torch.rand(num_tokens, top_k, generator=gen, device="cuda").softmax(-1)
    return x, topk_weights, topk_ids


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 512])
def test_fused_experts_real_shapes_bf16_gpu(gpu_moe_weights, num_tokens):
    top_k, w13, w2, (w13_fp32, w2_fp32) = gpu_moe_weights
    x, topk_weights, topk_ids = gpu_routing(num_tokens, w13.shape[0], top_k, w13.shape[2], 6)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == torch.bfloat16
    expected = torch_fused_experts(x.float(), w13_fp32, w2_fp32, topk_weights, topk_ids)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_fused_experts_cuda_graph_replays_any_routing_without_sync_gpu(gpu_moe_weights):
    """Captured at a fixed T, the graph must follow new routings on replay (nothing about the
    token counts is baked in on the host), and eager calls never wait on the device."""
    top_k, w13, w2, _ = gpu_moe_weights
    num_experts, hidden = w13.shape[0], w13.shape[2]
    x, topk_weights, topk_ids = gpu_routing(16, num_experts, top_k, hidden, 7)
    fused_experts(x, w13, w2, topk_weights, topk_ids)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_experts(x, w13, w2, topk_weights, topk_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, topk_weights, topk_ids)
    for seed in (8, 9):
        new_x, new_weights, new_ids = gpu_routing(16, num_experts, top_k, hidden, seed)
        x.copy_(new_x)
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, fused_experts(x, w13, w2, topk_weights, topk_ids),
                                   atol=0, rtol=0)
