"""The draft tree's Triton kernels (engine/spec/tree_kernels.py) against the torch code in
tree.py: the acceptance walk on random trees and chains (real and forced acceptance, depth
bounds), and a draft step's growth (the interpreter on the CPU; the device when there is one)."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from specserve.engine.spec import tree as tree_ops  # noqa: E402
from specserve.engine.spec import tree_kernels  # noqa: E402
from specserve.engine.spec.tree_kernels import accept_walk  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tree(bs, D, seed, chain=False):
    rng = random.Random(seed)
    parents = [[i - 1 if chain else rng.randrange(0, i) for i in range(1, D)] for _ in range(bs)]
    tokens = [[rng.randrange(0, 3) for _ in range(D - 1)] for _ in range(bs)]
    nodes = tree_ops.DraftNodes(torch.tensor(tokens), torch.tensor(parents))
    shape = tree_ops.TreeShape(1 if chain else 2, D - 1, D)
    return tree_ops.build_tree(nodes, torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64), shape)


@pytest.mark.parametrize("D,chain", [(2, True), (4, True), (8, False), (6, False), (10, False)])
@pytest.mark.parametrize("force_len", [None, 1, 3])
def test_kernel_matches_the_torch_walk(D, chain, force_len):
    bs = 40
    tree = _tree(bs, D, seed=D * 7 + (force_len or 0), chain=chain)
    # Targets drawn from the same 3 tokens as the drafts: walks of every length occur.
    target = torch.randint(0, 3, (bs, D), generator=torch.Generator().manual_seed(D))
    for max_depth in sorted({D - 1, max(1, D - 3)}):
        want = tree_ops.accept(tree, target, force_len, max_depth)
        got = accept_walk(*(t.to(DEVICE) for t in (tree.tokens, tree.parents, target)), max_depth, force_len)
        for name, a, b in zip(want._fields, got, want):
            assert torch.equal(a.cpu(), b), (name, max_depth)
    if force_len is None:
        assert len(set(want.lengths.tolist())) > 1  # the walks really differ


def test_empty_batch():
    empty = torch.zeros(0, 4, dtype=torch.int64, device=DEVICE)
    path, lengths, tokens = accept_walk(empty, empty, empty, 3, None)
    assert path.shape == (0, 4) and lengths.shape == (0,) and tokens.shape == (0, 4)


@pytest.mark.parametrize("bs,k,s", [(1, 2, 0), (3, 4, 2), (2, 3, 4), (2, 8, 1)])
def test_expand_kernel_matches_the_torch_step(bs, k, s):
    """Tie-free random scores (torch.topk leaves the order of equal scores open)."""
    gen = torch.Generator().manual_seed(bs * 100 + k * 10 + s)
    shape = tree_ops.TreeShape(k, 6, 1 + k * 3)
    builder = tree_ops.DraftTreeBuilder(shape, torch.rand(bs, k, generator=gen),
                                        torch.randint(0, 500, (bs, k), generator=gen), torch.zeros(bs, 2))
    frontier_scores = torch.rand(bs, k, generator=gen)
    probs = torch.softmax(torch.randn(bs * k, k, generator=gen), dim=-1)
    ids = torch.randint(0, 500, (bs * k, k), generator=gen)
    frontier_ids = torch.randint(0, 40, (bs, k), generator=gen)
    path_slots = torch.randint(0, 10_000, (bs, k, s), generator=gen)
    want = builder._expand_torch(frontier_scores, probs, ids, frontier_ids, path_slots, 17)
    got = tree_kernels.expand(*(t.to(DEVICE) for t in (frontier_scores, probs, ids, frontier_ids, path_slots)), 17)
    for name, a, b in zip(want._fields, got, want):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, msg=name)
        else:
            assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("D,chain", [(2, True), (4, True), (8, False), (9, False), (16, False)])
def test_build_tree_kernel_matches_the_torch_layout(D, chain):
    bs = 12
    rng = random.Random(D)
    parents = torch.tensor([[i - 1 if chain else rng.randrange(0, i) for i in range(1, D)] for _ in range(bs)])
    tokens = torch.randint(0, 300, (bs, D - 1), generator=torch.Generator().manual_seed(D))
    bonus, S = torch.arange(bs) + 500, torch.randint(0, 50, (bs,), generator=torch.Generator().manual_seed(1))
    shape = tree_ops.TreeShape(1 if chain else 2, D - 1, D)
    want = tree_ops.build_tree(tree_ops.DraftNodes(tokens, parents), bonus, S, shape)
    got = tree_kernels.build_tree(*(t.to(DEVICE) for t in (tokens, parents, bonus, S)), not chain)
    for name, a, b in zip(want._fields, got, want):
        assert (a is None) == (b is None), name
        if b is not None:
            assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("k,steps,D", [(2, 3, 6), (4, 5, 8), (8, 2, 10), (4, 4, 16)])
@pytest.mark.parametrize("ties", [False, True])
def test_keep_best_kernel_matches_the_stable_sort(k, steps, D, ties):
    """A grown tree's candidates kept as nodes: the D - 1 best by path probability, ties to
    the earlier candidate, parents before children (scores quantised for ties)."""
    gen = torch.Generator().manual_seed(k * 31 + D)
    bs = 5
    builder = tree_ops.DraftTreeBuilder(tree_ops.TreeShape(k, steps, D), torch.rand(bs, k, generator=gen),
                                        torch.randint(0, 500, (bs, k), generator=gen), torch.zeros(bs, 2))
    for _ in range(steps - 1):
        probs = torch.rand(bs * k, k, generator=gen)
        if ties:
            probs = (probs * 4).round() / 4  # many equal path probabilities
        builder.expand(probs.sort(dim=1, descending=True).values, torch.randint(0, 500, (bs * k, k), generator=gen),
                       torch.zeros(bs * k, 2))
    want = builder.finish()
    scores, tokens, parents = (torch.cat(x, dim=1) for x in (builder.scores, builder.tokens, builder.parents))
    got = tree_kernels.keep_best(scores.to(DEVICE), tokens.to(DEVICE), parents.to(DEVICE), D - 1)
    for name, a, b in zip(want._fields, got, want):
        assert torch.equal(a.cpu(), b), name
