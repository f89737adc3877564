"""Tree building and acceptance against brute-force constructions on random trees."""
from __future__ import annotations

import random

import torch

from specserve.engine.spec import tree as tree_ops


def _random_trees(bs, D, seed):
    rng = random.Random(seed)
    parents = [[rng.randrange(0, i) for i in range(1, D)] for _ in range(bs)]  # parent < child
    tokens = [[rng.randrange(0, 5) for _ in range(D - 1)] for _ in range(bs)]
    return parents, tokens


def test_build_tree_matches_brute_force():
    bs, D = 6, 9
    parents, tokens = _random_trees(bs, D, seed=1)
    S = torch.tensor([3, 10, 0, 7, 1, 4])
    nodes = tree_ops.DraftNodes(torch.tensor(tokens), torch.tensor(parents))
    tree = tree_ops.build_tree(nodes, torch.arange(bs) + 100, S, tree_ops.TreeShape(2, 4, D))
    for b in range(bs):
        par = [-1] + parents[b]
        for i in range(D):
            anc, j, depth = {i}, i, 0
            while par[j] >= 0:
                j = par[j]
                anc.add(j)
                depth += 1
            assert tree.mask[b, i].tolist() == [k in anc for k in range(D)]
            assert tree.positions[b, i].item() == S[b].item() + depth
            assert tree.slot_positions[b, i].item() == S[b].item() + i
        assert tree.tokens[b].tolist() == [100 + b] + tokens[b]


def test_accept_walk_matches_brute_force():
    bs, D = 50, 8
    parents, tokens = _random_trees(bs, D, seed=2)
    S = torch.zeros(bs, dtype=torch.int64)
    nodes = tree_ops.DraftNodes(torch.tensor(tokens), torch.tensor(parents))
    tree = tree_ops.build_tree(nodes, torch.zeros(bs, dtype=torch.int64), S, tree_ops.TreeShape(2, 7, D))
    target = torch.randint(0, 5, (bs, D), generator=torch.Generator().manual_seed(3))
    acc = tree_ops.accept(tree, target)
    for b in range(bs):
        par, tok = [-1] + parents[b], [0] + tokens[b]
        path, cur = [0], 0
        while True:
            child = next((i for i in range(D) if par[i] == cur and tok[i] == target[b, cur].item()), None)
            if child is None:
                break
            path.append(child)
            cur = child
        n = len(path)
        assert acc.lengths[b].item() == n
        assert acc.path[b, :n].tolist() == path
        assert acc.tokens[b, :n].tolist() == [target[b, p].item() for p in path]


def test_draft_builder_keeps_best_paths_parents_first():
    """Two levels of top-2 with known probabilities: the kept nodes are the best by path
    probability, and each node's parent is kept and comes before it."""
    shape = tree_ops.TreeShape(topk=2, num_steps=2, num_draft_tokens=4)
    builder = tree_ops.DraftTreeBuilder(shape, torch.tensor([[0.6, 0.4]]), torch.tensor([[10, 11]]),
                                        torch.zeros(1, 3))
    builder.record_slots(torch.tensor([[1, 2]]))
    # children of 10: (20: .9, 21: .1); children of 11: (22: .5, 23: .5)
    builder.expand(torch.tensor([[0.9, 0.1], [0.5, 0.5]]), torch.tensor([[20, 21], [22, 23]]), torch.zeros(2, 3))
    nodes = builder.finish()
    # scores: 10:.6 11:.4 20:.54 21:.06 22:.2 23:.2 -> keep 10, 11, 20 (node order: 10, 11, 20)
    assert nodes.tokens.tolist() == [[10, 11, 20]]
    assert nodes.parents.tolist() == [[0, 0, 1]]
