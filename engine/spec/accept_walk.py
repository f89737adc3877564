"""The acceptance walk of a draft tree in one Triton kernel (one program per request).

In torch the walk costs about ten small kernels per tree level (find the children of the
current node, compare their tokens with the target's, take the first match, advance), so
a 5-level tree spent ~50 launches of a few microseconds each on it. Here a program loads
its request's D nodes once and walks in registers; the result (path, lengths, the target's
tokens along the path) is exactly `tree.accept`'s torch walk, which stays the path off CUDA.
"""
from __future__ import annotations

from typing import Optional

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
