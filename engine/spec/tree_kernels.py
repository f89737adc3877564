"""Triton kernels for a draft tree's small index work, one program per request.

In torch this work is a cluster of tiny kernels of a few microseconds each, launched per
tree level: the acceptance walk costs about ten per level (children of the current node,
their tokens against the target's, the first match, advance), growing the tree about
eight per draft step (child scores, their parents, the top-k, the new frontier's ids,
tokens, hidden rows and ancestry), keeping the best D - 1 candidates as nodes about fifteen,
and laying out the verify tree (nodes after the bonus,
depths, ancestor mask) about twenty. Here a program loads its request's few values once and
does the level in registers. Results equal the torch code in `tree.py`, which stays the path
off CUDA (for ties in the top-k: torch.topk does not specify which of equal scores comes
first; these kernels take the lower index).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build needs no Triton
    triton = None


if triton is not None:
    @triton.jit
    def _accept_walk_kernel(tokens, parents, target, path_out, lengths_out, path_tokens_out, force_len,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, MAX_DEPTH: tl.constexpr,
                            FORCE: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_D)
        valid = offs < D
        base = row.to(tl.int64) * D
        tok = tl.load(tokens + base + offs, mask=valid, other=-1)
        par = tl.load(parents + base + offs, mask=valid, other=-2)
        tgt = tl.load(target + base + offs, mask=valid, other=0)
        cur = tl.full([], 0, tl.int64)
        alive = tl.full([], 1, tl.int32)
        length = tl.full([], 1, tl.int64)
        path = tl.zeros([BLOCK_D], dtype=tl.int64)
        for depth in tl.static_range(1, MAX_DEPTH + 1):
            is_child = (par == cur) & valid
            if FORCE:
                ok = is_child & (depth < force_len)
            else:
                at_cur = tl.sum(tl.where(offs == cur, tgt, 0), axis=0)   # the target's token at cur
                ok = is_child & (tok == at_cur)
            child = tl.min(tl.where(ok, offs, BLOCK_D), axis=0)          # the first matching child
            found = (child < BLOCK_D) & (alive != 0)
            cur = tl.where(found, child.to(tl.int64), cur)
            alive = found.to(tl.int32)
            length += found.to(tl.int64)
            path = tl.where(offs == depth, cur, path)
        path = tl.where(offs > MAX_DEPTH, cur, path)                    # padded with the last node
        tl.store(path_out + base + offs, path, mask=valid)
        tl.store(lengths_out + row, length)
        tl.store(path_tokens_out + base + offs, tl.load(target + base + path, mask=valid, other=0), mask=valid)


def accept_walk(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, max_depth: int,
                force_len: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(path [bs, D], lengths [bs], target tokens along the path [bs, D]) of the walk over
    `max_depth` levels (any device Triton runs on; int64 inputs of shape [bs, D])."""
    bs, D = tokens.shape
    tokens, parents, target = (t.contiguous() for t in (tokens, parents, target))
    path = torch.empty_like(tokens)
    lengths = torch.empty(bs, dtype=torch.int64, device=tokens.device)
    path_tokens = torch.empty_like(target)
    if bs:
        _accept_walk_kernel[(bs,)](tokens, parents, target, path, lengths, path_tokens,
                                   force_len if force_len is not None else 0, D=D,
                                   BLOCK_D=triton.next_power_of_2(D), MAX_DEPTH=max_depth,
                                   FORCE=force_len is not None, num_warps=1)
    return path, lengths, path_tokens


def use_kernel(t: torch.Tensor) -> bool:
    return triton is not None and t.device.type == "cuda"


class Expanded(NamedTuple):
    """One draft step's growth of a tree (see `DraftTreeBuilder.expand`)."""

    child_scores: torch.Tensor    # [bs, k * k] path probability of every child
    child_parents: torch.Tensor   # [bs, k * k] the candidate id of its parent
    best_scores: torch.Tensor     # [bs, k] the k best children, best first
    frontier_ids: torch.Tensor    # [bs, k] their candidate ids (base + child index)
    frontier_tokens: torch.Tensor  # [bs, k]
    hidden_rows: torch.Tensor     # [bs * k] the row of out_hidden each new branch reads (its parent's)
    path_slots: torch.Tensor      # [bs, k, s] their ancestry's draft KV slots (the parent's)


if triton is not None:
    @triton.jit
    def _expand_kernel(frontier_scores, probs, ids, frontier_ids, path_slots, child_scores_out,
                       child_parents_out, best_scores_out, frontier_ids_out, tokens_out, rows_out,
                       path_out, base, K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                       S: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        C: tl.constexpr = K * K
        offs = tl.arange(0, BLOCK_C)
        valid = offs < C
        parent = offs // K
        scores = tl.load(frontier_scores + b * K + parent, mask=valid, other=0.0) * \
            tl.load(probs + b * C + offs, mask=valid, other=0.0)
        tl.store(child_scores_out + b * C + offs, scores, mask=valid)
        tl.store(child_parents_out + b * C + offs, tl.load(frontier_ids + b * K + parent, mask=valid, other=0),
                 mask=valid)
        # The top K, best first, ties to the lower index: K rounds of max, then first argmax.
        offs_k = tl.arange(0, BLOCK_K)
        left = valid
        best = tl.zeros([BLOCK_K], dtype=tl.int32)
        best_scores = tl.zeros([BLOCK_K], dtype=tl.float32)
        for j in tl.static_range(K):
            top = tl.max(tl.where(left, scores, float("-inf")), axis=0)
            pick = tl.min(tl.where(left & (scores == top), offs, BLOCK_C), axis=0)
            best = tl.where(offs_k == j, pick, best)
            best_scores = tl.where(offs_k == j, top, best_scores)
            left = left & (offs != pick)
        in_k = offs_k < K
        parent_pos = best // K
        tl.store(best_scores_out + b * K + offs_k, best_scores, mask=in_k)
        tl.store(frontier_ids_out + b * K + offs_k, base + best.to(tl.int64), mask=in_k)
        tl.store(tokens_out + b * K + offs_k, tl.load(ids + b * C + best, mask=in_k, other=0), mask=in_k)
        tl.store(rows_out + b * K + offs_k, (b * K + parent_pos).to(tl.int64), mask=in_k)
        if S > 0:
            offs_s = tl.arange(0, BLOCK_S)
            cell = in_k[:, None] & (offs_s < S)[None, :]
            slots = tl.load(path_slots + b * K * S + parent_pos[:, None] * S + offs_s[None, :], mask=cell, other=0)
            tl.store(path_out + b * K * S + offs_k[:, None] * S + offs_s[None, :], slots, mask=cell)


def expand(frontier_scores: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, frontier_ids: torch.Tensor,
           path_slots: torch.Tensor, base: int) -> Expanded:
    """One kernel for `DraftTreeBuilder.expand`'s index work (k = topk > 1): frontier_scores
    [bs, k] float32, probs and ids [bs * k, k] (child j of branch f at [b * k + f, j]),
    frontier_ids [bs, k], path_slots [bs, k, s] int64; `base` the first new candidate id."""
    bs, k = frontier_scores.shape
    s = path_slots.shape[2]
    device = frontier_scores.device
    out = Expanded(torch.empty(bs, k * k, dtype=torch.float32, device=device),
                   torch.empty(bs, k * k, dtype=torch.int64, device=device),
                   torch.empty(bs, k, dtype=torch.float32, device=device),
                   torch.empty(bs, k, dtype=torch.int64, device=device),
                   torch.empty(bs, k, dtype=ids.dtype, device=device),
                   torch.empty(bs * k, dtype=torch.int64, device=device),
                   torch.empty(bs, k, s, dtype=path_slots.dtype, device=device))
    if bs:
        _expand_kernel[(bs,)](frontier_scores.float().contiguous(), probs.float().contiguous(), ids.contiguous(),
                              frontier_ids.contiguous(), path_slots.contiguous(), *out, base, K=k,
                              BLOCK_C=triton.next_power_of_2(k * k), BLOCK_K=triton.next_power_of_2(k),
                              S=s, BLOCK_S=triton.next_power_of_2(max(s, 1)), num_warps=1)
    return out



if triton is not None:
    @triton.jit
    def _build_tree_kernel(node_tokens, node_parents, bonus, S, tokens_out, parents_out, positions_out,
                           chain_pos_out, mask_out, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           TREE: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_D)
        valid = offs < D
        is_node = valid & (offs > 0)
        base = b.to(tl.int64) * D
        node_base = b.to(tl.int64) * (D - 1)
        tok = tl.load(node_tokens + node_base + offs - 1, mask=is_node, other=0)
        tok = tl.where(offs == 0, tl.load(bonus + b), tok)
        par = tl.load(node_parents + node_base + offs - 1, mask=is_node, other=-1)
        start = tl.load(S + b)
        tl.store(tokens_out + base + offs, tok, mask=valid)
        tl.store(parents_out + base + offs, par, mask=valid)
        tl.store(chain_pos_out + base + offs, start + offs, mask=valid)
        if TREE:
            # Parents come before their children: node i's row is its parent's plus itself.
            rows = offs[:, None]
            cols = offs[None, :]
            anc = rows == cols
            depth = tl.zeros([BLOCK_D], dtype=tl.int64)
            for i in tl.static_range(1, D):
                p = tl.sum(tl.where(offs == i, par, 0), axis=0)
                parent_row = tl.sum(tl.where(rows == p, anc.to(tl.int32), 0), axis=0) > 0
                anc = tl.where(rows == i, parent_row[None, :] | (cols == i), anc)
                depth = tl.where(offs == i, tl.sum(tl.where(offs == p, depth, 0), axis=0) + 1, depth)
            tl.store(positions_out + base + offs, start + depth, mask=valid)
            cell = valid[:, None] & valid[None, :]
            tl.store(mask_out + b.to(tl.int64) * D * D + rows * D + cols, anc, mask=cell)


def build_tree(node_tokens: torch.Tensor, node_parents: torch.Tensor, bonus: torch.Tensor, S: torch.Tensor,
               tree: bool):
    """(tokens, parents, positions, chain positions, mask or None) of `tree.build_tree` in one
    kernel: node_tokens / node_parents [bs, D - 1] (parents before children), bonus and S [bs]."""
    bs, D = node_tokens.shape[0], node_tokens.shape[1] + 1
    device = bonus.device
    tokens, parents, chain_pos = (torch.empty(bs, D, dtype=torch.int64, device=device) for _ in range(3))
    positions = torch.empty(bs, D, dtype=torch.int64, device=device) if tree else chain_pos
    mask = torch.empty(bs, D, D, dtype=torch.bool, device=device) if tree else None
    if bs:
        _build_tree_kernel[(bs,)](node_tokens.contiguous(), node_parents.contiguous(), bonus.contiguous(),
                                  S.contiguous(), tokens, parents, positions, chain_pos,
                                  mask if tree else tokens, D=D, BLOCK_D=triton.next_power_of_2(D),
                                  TREE=tree, num_warps=1)
    return tokens, parents, positions, chain_pos, mask



if triton is not None:
    @triton.jit
    def _keep_best_kernel(scores, tokens, parents, node_tokens_out, node_parents_out, C: tl.constexpr,
                          KEEP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_C)
        valid = offs < C
        base = b.to(tl.int64) * C
        sc = tl.load(scores + base + offs, mask=valid, other=0.0)
        # The KEEP best, ties to the earlier candidate (a stable descending sort's first KEEP).
        left = valid
        chosen = offs < 0
        for _ in tl.static_range(KEEP):
            top = tl.max(tl.where(left, sc, float("-inf")), axis=0)
            pick = tl.min(tl.where(left & (sc == top), offs, BLOCK_C), axis=0)
            chosen = chosen | (offs == pick)
            left = left & (offs != pick)
        # Kept candidates in id order (parents first) are nodes 1..KEEP; others map to 0 (root).
        node_of = tl.where(chosen, tl.cumsum(chosen.to(tl.int32), axis=0), 0)
        tok = tl.load(tokens + base + offs, mask=valid, other=0)
        par = tl.load(parents + base + offs, mask=valid, other=-1)
        nodes = tl.arange(0, BLOCK_K)
        is_node = (node_of[None, :] == nodes[:, None] + 1) & chosen[None, :]         # [node, candidate]
        node_tok = tl.sum(tl.where(is_node, tok[None, :], 0), axis=1)
        cand_parent = tl.sum(tl.where(is_node, par[None, :], 0), axis=1)
        parent_node = tl.sum(tl.where(offs[None, :] == cand_parent[:, None], node_of[None, :], 0), axis=1)
        keep = nodes < KEEP
        tl.store(node_tokens_out + b.to(tl.int64) * KEEP + nodes, node_tok, mask=keep)
        tl.store(node_parents_out + b.to(tl.int64) * KEEP + nodes,
                 tl.where(cand_parent < 0, 0, parent_node).to(tl.int64), mask=keep)


def keep_best(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, keep: int):
    """(node tokens, node parents) [bs, keep] of `DraftTreeBuilder.finish` in one kernel:
    candidates' scores, tokens and parent candidate ids (-1: the root) [bs, C]."""
    bs, C = scores.shape
    node_tokens = torch.empty(bs, keep, dtype=tokens.dtype, device=tokens.device)
    node_parents = torch.empty(bs, keep, dtype=torch.int64, device=tokens.device)
    if bs:
        _keep_best_kernel[(bs,)](scores.float().contiguous(), tokens.contiguous(), parents.contiguous(),
                                 node_tokens, node_parents, C=C, KEEP=keep, BLOCK_C=triton.next_power_of_2(C),
                                 BLOCK_K=triton.next_power_of_2(keep), num_warps=1)
    return node_tokens, node_parents
