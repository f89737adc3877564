"""The decode MoE kernels against the torch path (`layers/moe.py`) in fp32: the experts
(`layers/moe_decode.py`) and the softmax top-k router (`layers/moe_router.py`), in the
interpreter on the CPU (tiny shapes) and, marked `gpu`, at Qwen3-30B-A3B and DeepSeek-V2-Lite
shapes in bf16 and under CUDA-graph replay."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from test_fused_moe import random_gpu_experts, random_moe, reference_experts  # noqa: E402

from specserve.engine.layers.moe import can_fuse_router, select_experts  # noqa: E402
from specserve.engine.layers.moe_decode import (  # noqa: E402
    MAX_DECODE_TOKENS, DecodeMoEConfig, decode_fused_experts)
from specserve.engine.layers.moe_router import (  # noqa: E402
    MAX_ROUTER_TOKENS, router_softmax_topk, softmax_topk)
from specserve.engine.layers.skinny_gemm import workspace_for  # noqa: E402

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


def shared_mlp(x, w13, w2, num_shared):
    """The shared experts as DeepSeek's one MLP of S*I units, from the stacks' last S slots
    (slot j: the MLP's gate, up rows and down columns [j*I, (j+1)*I))."""
    inter = w2.shape[2]
    gate = torch.cat([w[:inter] for w in w13[-num_shared:]]).float()
    up = torch.cat([w[inter:] for w in w13[-num_shared:]]).float()
    down = torch.cat(list(w2[-num_shared:]), dim=1).float()
    return F.linear(F.silu(F.linear(x.float(), gate)) * F.linear(x.float(), up), down)


def shared_slot_moe(num_tokens, num_experts, top_k, num_shared, scaling, gen, ids=None):
    """Inputs and stacks of E routed experts + S shared slots, routed by select_experts (torch
    path) with the shared slots appended, or with the given routed `ids`."""
    x, w13, w2, _, _ = random_moe(num_tokens, num_experts + num_shared, top_k, 40, 24, gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 3
    if ids is not None:  # these experts, far ahead of the others
        logits.scatter_(1, ids, 20.0 + torch.arange(top_k, dtype=torch.float32).expand(num_tokens, -1))
    weights, topk_ids = select_experts(logits, top_k=top_k, scoring="softmax",
                                       routed_scaling_factor=scaling, num_shared=num_shared)
    return x, w13, w2, weights.to(DEVICE), topk_ids.to(DEVICE)


# Every shared-slot count at the full 16 tokens; every token count (1 to 16: the entries'
# power-of-two block and its masked tail) with some count. (2, 1.0) was also crossed with
# every token count: the scaling only changes the routed weights the kernels are given,
# which (1, 1.0) and (2, 2.5) cover.
@pytest.mark.parametrize("num_tokens,num_shared,scaling", [
    (1, 2, 2.5), (2, 1, 1.0), (5, 3, 1.5), (9, 2, 2.5), (9, 1, 1.0),
    (16, 1, 1.0), (16, 2, 2.5), (16, 3, 1.5)])
def test_shared_slots_are_the_shared_mlp(num_tokens, num_shared, scaling):
    """DeepSeek's shared experts as the stacks' last slots, which routing lists for every token
    with weight 1.0 (routed_scaling_factor scales only the routed weights): the decode kernels'
    output is the routed experts' (the torch path) plus the shared MLP of S*I units; the
    combine's counters end at zero, so a second launch (a graph replay) gives the same."""
    gen = torch.Generator().manual_seed(num_tokens * 10 + num_shared)
    num_experts, top_k = 6, 2
    x, w13, w2, weights, ids = shared_slot_moe(num_tokens, num_experts, top_k, num_shared, scaling, gen)
    assert ids.shape == (num_tokens, top_k + num_shared)
    assert (ids[:, top_k:].cpu() == torch.arange(num_experts, num_experts + num_shared)).all()
    assert (weights[:, top_k:] == 1.0).all()
    routed = reference_experts(x, w13[:num_experts], w2[:num_experts], weights[:, :top_k],
                               ids[:, :top_k].contiguous())
    expected = routed + shared_mlp(x, w13, w2, num_shared)
    for _ in range(2):
        out = decode_fused_experts(x, w13, w2, weights, ids, SMALL)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert not workspace_for(x.device).arrivals.any()
    check(x, w13, w2, weights, ids)  # and the torch path over the slots, entry by entry


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_shared_slots_with_every_token_on_the_same_expert(num_tokens):
    """Every token picks expert 3 then 0, plus two shared slots: four live slots of M*4."""
    gen = torch.Generator().manual_seed(3)
    routed = torch.tensor([[3, 0]] * num_tokens)
    x, w13, w2, weights, ids = shared_slot_moe(num_tokens, 5, 2, 2, 1.5, gen, ids=routed)
    assert (ids[:, :2].sort(1).values.cpu() == routed.sort(1).values).all()
    expected = (reference_experts(x, w13[:5], w2[:5], weights[:, :2], ids[:, :2].contiguous())
                + shared_mlp(x, w13, w2, 2))
    torch.testing.assert_close(decode_fused_experts(x, w13, w2, weights, ids, SMALL), expected,
                               atol=1e-5, rtol=1e-5)


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


def assert_shared_slots(weights, ids, num_experts, top_k, num_shared):
    """The routing's last S columns: expert ids E.. with weight 1.0 (never scaled)."""
    assert weights.shape == ids.shape == (ids.shape[0], top_k + num_shared)
    shared = torch.arange(num_experts, num_experts + num_shared).expand(ids.shape[0], -1)
    assert torch.equal(ids[:, top_k:].cpu(), shared)
    assert (weights[:, top_k:] == 1.0).all()


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize,scaling,num_shared", [
    (1, 4, 1, False, 1.0, 0), (5, 60, 6, False, 1.5, 2), (16, 128, 8, True, 1.0, 0),
    (3, 8, 2, True, 2.0, 1), (2, 64, 6, False, 1.0, 2)])
def test_softmax_topk_matches_select_experts(num_tokens, num_experts, top_k, renormalize, scaling,
                                             num_shared):
    """60 experts: a non-power-of-two count (padded lanes are never picked); with shared slots
    after the k (DeepSeek's: scaled routed weights, unscaled shared ones)."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 3
    weights, ids = softmax_topk(logits.to(DEVICE), top_k, renormalize, scaling, num_shared)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert (weights[:, :top_k - 1] >= weights[:, 1:top_k]).all()  # largest first
    assert_shared_slots(weights, ids, num_experts, top_k, num_shared)
    expected = select_experts(logits, top_k=top_k, scoring="softmax", norm_topk_prob=renormalize,
                              routed_scaling_factor=scaling, num_shared=num_shared)  # the torch path
    assert_same_routing((weights, ids), expected)


def test_softmax_topk_edges():
    assert softmax_topk(torch.zeros(0, 8, device=DEVICE), 2, True)[1].shape == (0, 2)
    # Equal probabilities: the lowest indices, in order (both kernels' rounds pick by one key).
    logits = torch.zeros(2, 128, device=DEVICE)
    logits[1, 100:] = 1.0
    weights, ids = softmax_topk(logits, 8, True)
    assert ids.tolist() == [list(range(8)), list(range(100, 108))]
    assert torch.equal(weights, torch.full((2, 8), 0.125, device=DEVICE))
    x = torch.zeros(1, 32, device=DEVICE)
    assert router_softmax_topk(x, torch.ones(128, 32, device=DEVICE), 8, False)[1].tolist() == [list(range(8))]
    with pytest.raises(ValueError, match="top_k 9"):
        softmax_topk(torch.zeros(2, 8, device=DEVICE), 9, True)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize,scaling,dtype,num_shared", [
    (1, 64, 6, False, 1.0, torch.float32, 2), (5, 60, 6, False, 1.5, torch.bfloat16, 2),
    (16, 128, 8, True, 1.0, torch.float32, 0), (3, 8, 2, True, 2.0, torch.bfloat16, 1),
    (1, 128, 8, True, 1.0, torch.bfloat16, 0), (1, 128, 8, False, 1.0, torch.bfloat16, 0),
    (2, 256, 8, True, 2.5, torch.float32, 1),
    (MAX_ROUTER_TOKENS, 4, 4, True, 1.0, torch.float32, 3)])
def test_router_is_the_gemv_then_softmax_topk(num_tokens, num_experts, top_k, renormalize,
                                              scaling, dtype, num_shared):
    """The fused router against the torch path (F.linear of x.float() and the fp32 weight,
    then select_experts) on 16-bit and fp32 hidden states: 64 top-6 with 2 shared slots
    (DeepSeek-V2-Lite's), 60 experts (not a power of two), 128 top-8 (Qwen3-30B-A3B's,
    renormalised or not), 256 (two a program), every expert picked (k = E) and 3 shared slots
    past a power of two of entries; the counter left at zero, so a repeat routes the same."""
    gen = torch.Generator().manual_seed(num_experts + num_tokens)
    hidden = 200  # not a multiple of the K step: the tail is masked
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(num_experts, hidden, generator=gen).to(DEVICE)
    got = router_softmax_topk(x, weight, top_k, renormalize, scaling, num_shared)
    assert got[1].dtype == torch.int64
    assert_shared_slots(*got, num_experts, top_k, num_shared)
    expected = select_experts(F.linear(x.float(), weight).cpu(), top_k=top_k, scoring="softmax",
                              norm_topk_prob=renormalize, routed_scaling_factor=scaling,
                              num_shared=num_shared)
    assert_same_routing(got, expected)
    assert not workspace_for(x.device).arrivals.any()
    again = router_softmax_topk(x, weight, top_k, renormalize, scaling, num_shared)
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])


def test_router_refusals_and_dispatch():
    x, weight = torch.zeros(MAX_ROUTER_TOKENS + 1, 32, device=DEVICE), torch.zeros(8, 32, device=DEVICE)
    with pytest.raises(AssertionError, match="rows"):
        router_softmax_topk(x, weight, 2, True)
    with pytest.raises(ValueError, match="top_k 9"):
        router_softmax_topk(x[:1], weight, 9, True)
    if DEVICE.type == "cuda":  # decode-sized softmax routing without groups, only
        assert can_fuse_router(x[:16], "softmax", 1)
        assert not can_fuse_router(x, "softmax", 1)
        assert not can_fuse_router(x[:1], "sigmoid", 1) and not can_fuse_router(x[:1], "softmax", 4)


_COMPILE_ROUTER_FOR_SM90 = """
import torch
from specserve.engine.layers import moe_decode as D, moe_router as R
from sm90_compile import compile_sm90, t

bf16, f32, i32, i64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
# V2-Lite (64 experts top-6, hidden 2048) at M = 1, Qwen3-30B-A3B (128 top-8) at M = 1 and
# 16, and 256 experts (V3's count; two a program) at M = 4, as router_softmax_topk launches
# them.
for m, experts, top_k, per_program, block_k, warps in ((1, 64, 6, 1, 2048, 1), (1, 128, 8, 1, 2048, 1),
                                                       (16, 128, 8, 1, 512, 4), (4, 256, 8, 2, 256, 1)):
    ptx = compile_sm90(R._router_kernel, dict(
        x=t(bf16), w=t(f32), logits=t(f32), weights=t(f32), ids=t(i64), arrivals=t(i32), M=m,
        num_experts=experts, K=2048, stride_xm=2048, stride_wn=2048, scaling=1.0, TOP_K=top_k,
        NUM_SHARED={64: 2, 256: 1}.get(experts, 0), RENORMALIZE=experts == 128, BLOCK_M=m, EXPERTS_PER_PROGRAM=per_program, BLOCK_K=block_k,
        BLOCK_E=experts, BLOCK_TOPK=8, PDL=True), warps, 3)
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx and "atom" in ptx
    print("compiled router", experts)
# The down kernel with its combine at V2-Lite's shape (6 routed + 2 shared slots a token), at
# M = 1 and 16, waiting for its predecessor under PDL.
for m in (1, 16):
    ptx = compile_sm90(D._down_kernel, dict(
        intermediate=t(bf16), w2=t(bf16), weighted=t(bf16), out=t(bf16), arrivals=t(i32),
        topk_ids=t(i64), topk_weights=t(f32), num_tokens=m, num_entries=8 * m, N=2048, K=1408,
        stride_inter=1408, stride_we=2048 * 1408, stride_wn=1408, stride_wk=1,
        stride_weighted=2048, stride_out=2048, TOP_K=8, BLOCK_M=16, BLOCK_TOPK=8,
        BLOCK_ENTRIES=8 * m, BLOCK_N=32, BLOCK_K=128, DOT_PRECISION="tf32", PDL=True), 4, 4)
    assert "atom" in ptx and "mma" in ptx and "griddepcontrol.wait" in ptx
    assert "griddepcontrol.launch_dependents" in ptx
    print("compiled down", m)
"""


def test_decode_kernels_compile_for_hopper():
    from sm90_compile import compile_env

    done = subprocess.run([sys.executable, "-c", _COMPILE_ROUTER_FOR_SM90], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 6


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
