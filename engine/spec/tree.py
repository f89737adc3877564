"""Draft trees: growing them (EAGLE-2 style), their verify layout, acceptance and compaction.

A chain (topk = 1) is the tree whose nodes are in a line, so one code path serves both.
Node 0 of every request's block is the root (the bonus token at position S); node i > 0 is
a draft token at position S + depth(i) whose parent has a smaller index. Verify writes node
i's target KV at row position S + i; after acceptance the accepted path is moved to row
positions S .. S + len - 1 (the chain layout the rest of the engine assumes).

Draft KV during tree drafting has the exact ancestry: the frontier node f of draft step s
writes its draft KV to row position S + (s - 1) * topk + f, and attends to the prefix plus
the slots of its own ancestors only (not those of whichever branch happened to share its
frontier position, as SGLang's approximation does).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from specserve.engine.aranges import arange
from specserve.engine.layers.sampler import TokenHistory
from specserve.engine.spec import tree_kernels


class TreeShape(NamedTuple):
    topk: int
    num_steps: int
    num_draft_tokens: int

    @property
    def is_tree(self) -> bool:
        return self.topk > 1


class DraftNodes(NamedTuple):
    tokens: torch.Tensor    # [bs, D - 1] draft tokens of nodes 1..D-1
    parents: torch.Tensor   # [bs, D - 1] parent node index (0 = root)


class DraftChainBuilder:
    """topk = 1: each draft step appends the argmax of the last one. The frontier is the
    draft forward's output itself and a branch's ancestry is the request's own row (step s
    writes row position S + s - 1), so nothing is selected or gathered."""

    def __init__(self, shape: TreeShape, topk_index, hidden):
        self.shape = shape
        self.tokens = [topk_index]
        self.frontier_tokens = topk_index
        self.frontier_hidden = hidden

    def frontier(self):
        return self.frontier_tokens.reshape(-1), self.frontier_hidden

    def step_kv(self, table: torch.Tensor, S: torch.Tensor, branch_S: torch.Tensor, step: int):
        """(kv [bs, W], own slots [bs]) of draft step `step` (1-based)."""
        return table, table.gather(1, (S + (step - 1)).unsqueeze(1)).squeeze(1)

    def candidates(self):
        """(tokens [bs, C], parent candidate [bs, C] (-1: the root), frontier candidates [bs, 1]):
        what a grammar walks to mask the next draft step (structured outputs)."""
        tokens = torch.cat(self.tokens, dim=1)
        n = tokens.shape[1]
        parents = (arange(n, tokens.device) - 1).expand_as(tokens)
        return tokens, parents, parents[:, -1:] + 1

    def expand(self, probs: Optional[torch.Tensor], ids: torch.Tensor, out_hidden: torch.Tensor) -> None:
        self.tokens.append(ids)
        self.frontier_tokens = ids
        self.frontier_hidden = out_hidden

    def finish(self) -> DraftNodes:
        tokens = torch.cat(self.tokens, dim=1)
        bs, keep = tokens.shape
        return DraftNodes(tokens, arange(keep, tokens.device).expand(bs, keep))


class DraftTreeBuilder:
    """Accumulates candidates level by level; `finish` keeps the D - 1 best by path probability."""

    def __init__(self, shape: TreeShape, topk_p, topk_index, hidden):
        self.shape = shape
        bs, k = topk_index.shape
        self.bs = bs
        # Candidates: token, parent candidate (-1: the root), cumulative path probability.
        self.tokens = [topk_index]
        self.parents = [torch.full_like(topk_index, -1)]
        self.scores = [topk_p]
        # The frontier: the nodes the next draft forward reads.
        self.frontier_ids = arange(k, topk_index.device).expand(bs, k)  # candidate ids
        self.frontier_tokens = topk_index
        self.frontier_scores = topk_p
        self.frontier_hidden = hidden.repeat_interleave(k, dim=0)      # [bs * k, H]
        self.path_slots = topk_index.new_zeros((bs, k, 0))              # draft KV of the ancestry
        self.branch_kv: Optional[torch.Tensor] = None                   # per-branch KV rows (step_kv)
        self.num_candidates = k

    def frontier(self):
        return self.frontier_tokens.reshape(-1), self.frontier_hidden

    def record_slots(self, own_slots: torch.Tensor) -> torch.Tensor:
        """The frontier's draft KV slots for this step; returns their full ancestry [bs, k, s]."""
        self.path_slots = torch.cat([self.path_slots, own_slots.unsqueeze(2)], dim=2)
        return self.path_slots

    def step_kv(self, table: torch.Tensor, S: torch.Tensor, branch_S: torch.Tensor, step: int):
        """KV indices of draft step `step` (1-based): every branch sees the prefix and its
        ancestry. Branch f writes row position S + (step - 1) * k + f. `branch_S` is S per
        branch (S repeated k times).

        Returns (kv [bs * k, W], own slots [bs * k])."""
        k = self.shape.topk
        offsets = arange(self.shape.num_steps * k, S.device)[(step - 1) * k:step * k]
        own = table.gather(1, S.unsqueeze(1) + offsets)                  # [bs, k]
        path = self.record_slots(own)                                    # [bs, k, step]
        if step == 1:
            self.branch_kv = table.repeat_interleave(k, dim=0)          # [bs * k, W]
        # Rewritten in place each step: this step rewrites every ancestry column the last
        # one wrote (branches are reordered), and the last forward read it before (stream order).
        cols = branch_S.unsqueeze(1) + arange(step, S.device)
        self.branch_kv.scatter_(1, cols, path.reshape(-1, step))
        return self.branch_kv, own.reshape(-1)

    def candidates(self):
        """(tokens [bs, C], parent candidate [bs, C] (-1: the root), frontier candidates [bs, k]):
        what a grammar walks to mask the next draft step (structured outputs)."""
        return torch.cat(self.tokens, dim=1), torch.cat(self.parents, dim=1), self.frontier_ids

    def expand(self, probs: torch.Tensor, ids: torch.Tensor, out_hidden: torch.Tensor) -> None:
        """Children of the frontier from the draft forward's top-k; the best k become the next
        frontier. On CUDA the index work is one Triton kernel (tree_kernels.expand)."""
        base = self.num_candidates
        self.num_candidates += self.shape.topk ** 2
        grown = tree_kernels.expand if tree_kernels.use_kernel(ids) else self._expand_torch
        e = grown(self.frontier_scores, probs, ids, self.frontier_ids, self.path_slots, base)
        self.tokens.append(ids.view(self.bs, -1))
        self.parents.append(e.child_parents)
        self.scores.append(e.child_scores)
        self.frontier_ids, self.frontier_tokens, self.frontier_scores = e.frontier_ids, e.frontier_tokens, e.best_scores
        self.frontier_hidden = out_hidden[e.hidden_rows]
        self.path_slots = e.path_slots

    def _expand_torch(self, frontier_scores, probs, ids, frontier_ids, path_slots, base: int) -> tree_kernels.Expanded:
        bs, k = self.bs, self.shape.topk
        child_scores = (frontier_scores.unsqueeze(2) * probs.view(bs, k, k)).view(bs, k * k)
        best_scores, best = child_scores.topk(k, dim=1)
        parent_pos = best // k                         # frontier position of each new node's parent
        first_branch = arange(bs * k, ids.device).view(bs, k)[:, :1]   # b * k
        return tree_kernels.Expanded(
            child_scores, frontier_ids.repeat_interleave(k, dim=1), best_scores, base + best,
            ids.view(bs, k * k).gather(1, best), (first_branch + parent_pos).reshape(-1),
            path_slots.gather(1, parent_pos.unsqueeze(2).expand(-1, -1, path_slots.shape[2])))

    def finish(self) -> DraftNodes:
        tokens = torch.cat(self.tokens, dim=1)
        parents = torch.cat(self.parents, dim=1)
        keep = self.shape.num_draft_tokens - 1
        scores = torch.cat(self.scores, dim=1)
        if tree_kernels.use_kernel(scores):
            return DraftNodes(*tree_kernels.keep_best(scores, tokens, parents, keep))
        # Stable sort: on equal scores the earlier candidate (a parent before its child) wins.
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :keep]
        chosen = torch.sort(order, dim=1).values                        # parents before children
        # Candidate id -> node index (1-based; the root is node 0).
        node_of = torch.zeros_like(scores, dtype=torch.int64)
        node_of.scatter_(1, chosen, arange(keep + 1, chosen.device)[1:].expand(self.bs, keep))
        cand_parent = parents.gather(1, chosen)
        node_parent = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
        return DraftNodes(tokens.gather(1, chosen), node_parent)


def draft_builder(shape: TreeShape, topk_p, topk_index, hidden):
    """The builder of a draft tree, or of a chain when topk = 1 (which needs no scores)."""
    if shape.is_tree:
        return DraftTreeBuilder(shape, topk_p, topk_index, hidden)
    return DraftChainBuilder(shape, topk_index, hidden)


class Tree(NamedTuple):
    tokens: torch.Tensor          # [bs, D] node tokens, node 0 = bonus
    parents: torch.Tensor         # [bs, D] parent node (-1 for the root)
    positions: torch.Tensor       # [bs, D] S + depth
    slot_positions: torch.Tensor  # [bs, D] row position whose slot holds node i's KV: S + i
    mask: Optional[torch.Tensor]  # [bs, D, D] node i sees node j (ancestor or self); None: causal


def build_tree(nodes: DraftNodes, bonus: torch.Tensor, S: torch.Tensor, shape: TreeShape) -> Tree:
    """The verify layout of drafted nodes (parents before children) under the bonus token.
    On CUDA one Triton kernel (tree_kernels.build_tree)."""
    if tree_kernels.use_kernel(bonus):
        return Tree(*tree_kernels.build_tree(nodes.tokens, nodes.parents, bonus, S, shape.is_tree))
    bs = bonus.shape[0]
    D = shape.num_draft_tokens
    device = bonus.device
    tokens = torch.cat([bonus.unsqueeze(1), nodes.tokens], dim=1)
    parents = torch.cat([torch.full((bs, 1), -1, device=device, dtype=torch.int64), nodes.parents], dim=1)
    chain_pos = S.unsqueeze(1) + arange(D, device)
    if not shape.is_tree:
        return Tree(tokens, parents, chain_pos, chain_pos, None)
    # Ancestor-or-self by path doubling: `reach` starts as node -> itself and its parent; each
    # squaring doubles the distance it covers, until it covers any depth (D - 1).
    nodes_ids = arange(D, device)
    reach = ((parents.unsqueeze(2) == nodes_ids) | (nodes_ids.unsqueeze(1) == nodes_ids)).float()
    for _ in range(max(1, D - 2).bit_length()):
        reach = torch.bmm(reach, reach).clamp_(max=1.0)  # 0/1 counts: exact in any float format
    depth = reach.sum(2).long() - 1
    return Tree(tokens, parents, S.unsqueeze(1) + depth, chain_pos, reach > 0)


class Accept(NamedTuple):
    path: torch.Tensor     # [bs, D] accepted node indices (root first), padded with the last one
    lengths: torch.Tensor  # [bs] tokens emitted: accepted drafts + 1
    tokens: torch.Tensor   # [bs, D] the target's token at each path node: what is emitted

    def gather_path(self, per_node: torch.Tensor) -> torch.Tensor:
        """[bs, D, ...] per node -> the same along the accepted path."""
        index = self.path.view(*self.path.shape, *[1] * (per_node.dim() - 2)).expand_as(per_node)
        return per_node.gather(1, index)


def accept(tree: Tree, target_tokens: torch.Tensor, force_len: Optional[int] = None,
           max_depth: Optional[int] = None) -> Accept:
    """Walk from the root, at each node taking the child whose token is the target's own
    choice there. `force_len` (benchmarks on random weights only) takes the first child
    regardless, so exactly `force_len` tokens are emitted where the tree is deep enough.
    `max_depth` bounds the tree's depth when the caller knows it (a drafted tree has a level
    per draft step); by default D - 1. On CUDA the walk is one Triton kernel (tree_kernels.accept_walk)."""
    bs, D = tree.tokens.shape
    depth_bound = min(max_depth or D - 1, D - 1)
    if tree_kernels.use_kernel(target_tokens):
        return Accept(*tree_kernels.accept_walk(tree.tokens, tree.parents, target_tokens, depth_bound, force_len))
    if tree.mask is None:
        return _accept_chain(tree, target_tokens, force_len, depth_bound)
    device = tree.tokens.device
    cur = torch.zeros(bs, dtype=torch.int64, device=device)
    alive = torch.ones(bs, dtype=torch.bool, device=device)
    path = [cur]
    lengths = torch.ones(bs, dtype=torch.int64, device=device)
    node_ids = arange(D, device)
    for depth in range(1, depth_bound + 1):
        is_child = tree.parents == cur.unsqueeze(1)
        if force_len is not None:
            ok = is_child & (depth < force_len)
        else:
            ok = is_child & (tree.tokens == target_tokens.gather(1, cur.unsqueeze(1)))
        found = ok.any(dim=1) & alive
        child = torch.where(ok, node_ids, D).min(dim=1).values  # first matching child
        cur = torch.where(found, child, cur)
        alive = found
        lengths = lengths + found
        path.append(cur)
    path = torch.stack(path, dim=1)
    if path.shape[1] < D:
        path = torch.cat([path, path[:, -1:].expand(bs, D - path.shape[1])], dim=1)
    return Accept(path, lengths, target_tokens.gather(1, path))


def _accept_chain(tree: Tree, target_tokens: torch.Tensor, force_len: Optional[int], max_depth: int) -> Accept:
    """The walk along a chain in closed form: node j + 1 is accepted while every draft up to
    it equals the target's token at its parent j, so the path is 0 .. n (then n repeated)."""
    bs, D = tree.tokens.shape
    depth = arange(D, tree.tokens.device)
    if force_len is not None:
        matches = (depth[1:max_depth + 1] < force_len).expand(bs, max_depth)
    else:
        matches = tree.tokens[:, 1:max_depth + 1] == target_tokens[:, :max_depth]
    accepted = matches.cumprod(dim=1).sum(dim=1)          # leading matches
    path = torch.minimum(depth, accepted.unsqueeze(1))
    return Accept(path, accepted + 1, target_tokens.gather(1, path))


def compact_rows(per_node: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """[bs, D, F] rows reordered so the accepted path comes first (a copy)."""
    return per_node.gather(1, path.unsqueeze(2).expand(-1, -1, per_node.shape[2]))


def compaction_moves(loc: torch.Tensor, acc: Accept) -> tuple[torch.Tensor, torch.Tensor]:
    """(target slots, source slots) that move path node j's KV to row position S + j."""
    return loc.reshape(-1), loc.gather(1, acc.path).reshape(-1)


def node_history(rows: TokenHistory, tree: Tree) -> TokenHistory:
    """[bs * D, V] per node: the request's history plus the node's own draft ancestors (the
    tokens before it on its path, itself included; node 0, the bonus, is in the history)."""
    bs, D = tree.tokens.shape
    in_sequence = rows.in_sequence.unsqueeze(1).repeat(1, D, 1)
    counts = rows.output_counts.unsqueeze(1).repeat(1, D, 1)
    sees = tree.mask if tree.mask is not None else \
        torch.ones(D, D, dtype=torch.bool, device=counts.device).tril().expand(bs, D, D)
    for j in range(1, D):
        idx = tree.tokens[:, j].view(bs, 1, 1).expand(bs, D, 1)
        in_sequence.scatter_(2, idx, in_sequence.gather(2, idx) | sees[:, :, j:j + 1])
        counts.scatter_add_(2, idx, sees[:, :, j:j + 1].to(counts.dtype))
    return TokenHistory(in_sequence.view(bs * D, -1), counts.view(bs * D, -1))
