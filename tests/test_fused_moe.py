"""The fused MoE Triton kernels against the torch path (`layers/moe.py`, in fp32): in the
interpreter on the CPU (tiny shapes, fp32) and, marked `gpu`, at DeepSeek shapes in bf16."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from specserve.engine.layers.fused_moe_triton import (  # noqa: E402
    MoEConfig, align_entries_by_expert, align_plan, fused_experts)
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


def reference_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The layout in torch: expert e's entries in increasing order from the end of the runs
    before it, each run padded to a multiple of block_m with the sentinel num_entries, then
    sentinels up to the host bound; a block's expert is the count of runs ending at or before
    it (num_experts past the total)."""
    flat = topk_ids.reshape(-1).cpu().long()
    num_entries = flat.numel()
    max_padded = num_entries + min(num_experts, num_entries) * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    sorted_entries = torch.full((max_padded,), num_entries, dtype=torch.int32)
    order = torch.sort(flat, stable=True).indices.int()
    sorted_flat = flat[order.long()]
    for expert in range(num_experts):
        start = int(ends[expert] - padded[expert])
        sorted_entries[start:start + counts[expert]] = order[sorted_flat == expert]
    block_rows = torch.arange(0, max_padded, block_m)
    block_experts = (ends[None, :] <= block_rows[:, None]).sum(1).int()
    return sorted_entries, block_experts, int(padded.sum())


def check_alignment(topk_ids, num_experts, block_m, plan=None):
    alignment = align_entries_by_expert(topk_ids.to(DEVICE), num_experts, block_m, plan)
    sorted_entries, block_experts, num_padded = reference_alignment(topk_ids, num_experts, block_m)
    assert int(alignment.num_padded) == num_padded
    assert torch.equal(alignment.sorted_entries.cpu(), sorted_entries)
    assert torch.equal(alignment.block_experts.cpu(), block_experts)


def random_ids(num_entries: int, num_experts: int, seed: int, experts=None) -> torch.Tensor:
    """Ids drawn with repeats (a tile holds runs of the same expert), from `experts` if given."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.arange(num_experts) if experts is None else torch.as_tensor(experts)
    return pool[torch.randint(len(pool), (num_entries,), generator=gen)].view(-1, 1)


# One program in one launch (16 x 8: a decode step with 2 shared slots), a non-multiple of
# the tile, several programs, and a prefill's many programs of several tiles each (10000
# entries: 79 programs of 2 or 4 tiles, as 40000 entries make 79 of 8 or 16).
@pytest.mark.parametrize("num_entries", [128, 222, 1000, 10000])
@pytest.mark.parametrize("num_experts", [64, 66, 128, 160, 256])
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_align_matches_reference(num_entries, num_experts, block_m):
    if num_entries == 10000 and block_m != 64:
        pytest.skip("the interpreter's slowest case: one block size is enough")
    plan = align_plan(num_entries, num_experts)
    assert (plan.num_programs == 1) == (num_entries <= 4 * plan.block_t)
    if num_entries == 10000:
        assert plan.tiles > 1 and plan.num_programs > 64
    check_alignment(random_ids(num_entries, num_experts, num_entries + num_experts),
                    num_experts, block_m)


@pytest.mark.parametrize("num_experts", [64, 66, 256])
@pytest.mark.parametrize("plan_args", [
    dict(block_t=16, max_programs=128),   # many one-tile programs: the count table in steps
    dict(block_t=16, max_programs=7),     # few programs of many tiles, the last one partial
    dict(block_t=16, single_program_tiles=64),  # one program looping over its tiles
])
def test_align_plans(num_experts, plan_args):
    num_entries = 16 * 125 + 3
    plan = align_plan(num_entries, num_experts, **plan_args)
    check_alignment(random_ids(num_entries, num_experts, 11), num_experts, 16, plan)


@pytest.mark.parametrize("num_entries", [5, 300, 3000])
@pytest.mark.parametrize("expert", [0, 65])
def test_align_all_entries_on_one_expert(num_entries, expert):
    ids = torch.full((num_entries, 1), expert, dtype=torch.int32)
    check_alignment(ids, 66, 16)
    check_alignment(ids, 66, 16, align_plan(num_entries, 66, block_t=16, max_programs=9))


@pytest.mark.parametrize("num_entries", [40, 2000])
def test_align_empty_experts(num_entries):
    """Most experts get nothing: the even ones, or the last two (the shared slots) alone."""
    check_alignment(random_ids(num_entries, 66, 12, experts=range(0, 66, 2)), 66, 32)
    check_alignment(random_ids(num_entries, 66, 13, experts=[64, 65]), 66, 16)


def test_align_int64_ids_and_no_entries():
    ids = torch.rand(50, 66, generator=torch.Generator().manual_seed(14)).topk(8, 1).indices
    assert ids.dtype == torch.int64
    check_alignment(ids, 66, 16)
    alignment = align_entries_by_expert(ids[:0].to(DEVICE), 66, 16)
    assert alignment.sorted_entries.numel() == 0 and int(alignment.num_padded) == 0


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


_COMPILE_ALIGN_FOR_SM90 = """
import torch
from specserve.engine.layers import fused_moe_triton as F
from sm90_compile import compile_sm90, t

i32, i64 = torch.int32, torch.int64
# A decode step (16 x 8 entries: one program), V2-Lite's NextN verify at batch 64 (256 x 8,
# 66 experts with the shared slots), and prefills (many programs of several tiles) up to
# V3's 256 experts, as align_entries_by_expert launches them.
for entries, experts, block_m in ((16 * 8, 66, 16), (256 * 8, 66, 16), (256 * 8, 64, 32),
                                  (4096 * 8, 66, 64), (4096 * 8, 256, 64)):
    plan = F.align_plan(entries, experts)
    max_padded, rows, constants = F._align_sizes(entries, experts, block_m, plan)
    if not constants["COUNT_HERE"]:
        compile_sm90(F._align_count_kernel, dict(
            topk_ids=t(i64), chunk_counts=t(i32), num_entries=entries, NUM_EXPERTS=experts,
            BLOCK_E=constants["BLOCK_E"], BLOCK_T=plan.block_t, TILES=plan.tiles),
            plan.num_warps, 1)
    compile_sm90(F._align_scatter_kernel, dict(
        topk_ids=t(i64), chunk_counts=t(i32), sorted_entries=t(i32), block_experts=t(i32),
        num_padded=t(i32), num_entries=entries, max_padded=max_padded, rows_per_program=rows,
        **constants), plan.num_warps, 1)
    print("compiled align", entries, experts, block_m, plan)
"""


def test_align_kernels_compile_for_hopper():
    """What the interpreter cannot show: the compiler accepts both alignment kernels (the
    [BLOCK_T, BLOCK_T] rank tile, the one-hot gathers) at the launched shapes."""
    from sm90_compile import compile_env

    done = subprocess.run([sys.executable, "-c", _COMPILE_ALIGN_FOR_SM90], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 5, done.stdout


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
