"""Tree building and acceptance against brute-force constructions on random trees."""
from __future__ import annotations

import random

import torch

from specserve.engine.layers.sampler import draft_topk
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


def _walk(tree, target, force_len=None):
    """The generic tree walk (what `accept` does for a tree), run on any tree."""
    return tree_ops.accept(tree._replace(mask=torch.ones(1, dtype=torch.bool)), target, force_len)


def test_chain_accept_in_closed_form_matches_the_walk():
    """Chains take a closed form instead of the walk: same path, lengths and tokens, with
    every prefix of matching drafts and with the bench-only forced length."""
    D, bs = 5, 64
    gen = torch.Generator().manual_seed(4)
    target = torch.randint(0, 3, (bs, D), generator=gen)
    drafts = torch.randint(0, 3, (bs, D - 1), generator=gen)
    for n in range(D):  # row n accepts exactly n drafts
        drafts[n, :n] = target[n, :n]
        if n < D - 1:
            drafts[n, n] = (target[n, n] + 1) % 3
    nodes = tree_ops.DraftNodes(drafts, torch.arange(D - 1).expand(bs, D - 1))
    chain = tree_ops.build_tree(nodes, torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64),
                                tree_ops.TreeShape(1, D - 1, D))
    assert chain.mask is None
    for force_len in (None, 1, 3, D, D + 2):
        got, want = tree_ops.accept(chain, target, force_len), _walk(chain, target, force_len)
        for a, b in zip(got, want):
            assert torch.equal(a, b), force_len
    assert set(tree_ops.accept(chain, target).lengths.tolist()) == set(range(1, D + 1))


def test_chain_builder_matches_the_tree_builder_at_topk_1():
    """DraftChainBuilder (no selection, the row's own slots as ancestry) drafts what the
    general tree builder would with one branch: same nodes, same KV rows and slots."""
    shape = tree_ops.TreeShape(topk=1, num_steps=4, num_draft_tokens=5)
    bs, W = 3, 16
    gen = torch.Generator().manual_seed(5)
    table = torch.randint(0, 1000, (bs, W), generator=gen)
    S = torch.tensor([2, 7, 5])
    first = torch.randint(0, 50, (bs, 1), generator=gen)
    hidden = torch.randn(bs, 4, generator=gen)
    chain = tree_ops.draft_builder(shape, None, first, hidden)
    general = tree_ops.DraftTreeBuilder(shape, torch.ones(bs, 1), first, hidden)
    assert isinstance(chain, tree_ops.DraftChainBuilder)
    for step in range(1, shape.num_steps):
        for a, b in zip(chain.frontier(), general.frontier()):
            assert torch.equal(a, b)
        (kv_c, own_c), (kv_g, own_g) = chain.step_kv(table, S, S, step), general.step_kv(table, S, S, step)
        assert torch.equal(own_c, own_g)
        for b in range(bs):  # what a branch reads: its prefix and its ancestry
            assert torch.equal(kv_c[b, :S[b] + step], kv_g[b, :S[b] + step])
            assert torch.equal(kv_g[b, S[b] + step:], table[b, S[b] + step:])  # the rest untouched
        ids = torch.randint(0, 50, (bs, 1), generator=gen)
        out = torch.randn(bs, 4, generator=gen)
        chain.expand(None, ids, out)
        general.expand(torch.rand(bs, 1, generator=gen), ids, out)
    for a, b in zip(chain.finish(), general.finish()):
        assert torch.equal(a, b)


def test_draft_topk_chain_argmax_is_the_softmax_argmax():
    """Chain drafting skips the softmax: the argmax of the logits is the token the softmax's
    max picked (ties included: both take the first), and with probabilities asked for, or
    k > 1, the result is the softmax's top-k as before."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(32, 300, generator=gen) * 4
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
    probs = torch.softmax(logits, dim=-1)
    p, ids = draft_topk(logits, 1, with_probs=False)
    assert p is None and torch.equal(ids, probs.max(dim=-1, keepdim=True).indices)
    assert ids[3].item() == 10
    p, ids = draft_topk(logits, 1)
    assert torch.equal(p, probs.max(dim=-1, keepdim=True).values)
    p, ids = draft_topk(logits, 4, with_probs=False)  # a tree's scores always need the probabilities
    want = probs.topk(4, dim=-1)
    assert torch.equal(p, want.values) and torch.equal(ids, want.indices)
