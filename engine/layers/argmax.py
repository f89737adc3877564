"""Row-wise argmax over a vocabulary, the greedy token of every row.

torch.argmax reduces a single row of 128k logits in one 28 us kernel on an H100 (a bs=1 decode
step's profile, `bench/step_profile.py`): one row gives it one block. Here the row is split into
chunks, one program each finds its chunk's max and first index, and a second kernel picks the
first chunk holding the overall max: the same first-maximum index as torch.argmax (for rows
without NaN), in two launches of a few microseconds. Off CUDA, torch.argmax.
"""
from __future__ import annotations

import torch

from specserve.engine.pdl import launch_options, wait_for_predecessor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build needs no Triton
    triton = None

BLOCK = 1024          # logits a program reads per loop iteration
MAX_CHUNKS = 64       # programs per row
MIN_CHUNK = 2048      # logits per program at the least


def argmax_last_dim(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a 2-D `x`."""
    if triton is None or x.device.type != "cuda" or x.dim() != 2 or x.shape[0] == 0:
        return torch.argmax(x, dim=-1)
    return chunked_argmax(x)


if triton is not None:
    @triton.jit
    def _chunk_max_kernel(x, chunk_max, chunk_index, num_cols, stride_row,
                          CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        wait_for_predecessor(PDL)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        begin = chunk * CHUNK
        offs = tl.arange(0, BLOCK)
        base = x + row.to(tl.int64) * stride_row
        best_value = tl.full([], float("-inf"), tl.float32)
        best_index = tl.minimum(begin, num_cols - 1)  # an all -inf chunk: its first column
        for start in range(begin, begin + CHUNK, BLOCK):
            cols = start + offs
            values = tl.load(base + cols, mask=cols < num_cols, other=float("-inf")).to(tl.float32)
            block_max = tl.max(values, 0)
            # Strictly greater: an equal maximum later in the chunk keeps the earlier index.
            if block_max > best_value:
                best_value = block_max
                best_index = start + tl.argmax(values, 0, tie_break_left=True)
        tl.store(chunk_max + row * NUM_CHUNKS + chunk, best_value)
        tl.store(chunk_index + row * NUM_CHUNKS + chunk, best_index)

    @triton.jit
    def _pick_chunk_kernel(chunk_max, chunk_index, out, NUM_CHUNKS: tl.constexpr,
                           BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        wait_for_predecessor(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_C)
        valid = offs < NUM_CHUNKS
        values = tl.load(chunk_max + row * NUM_CHUNKS + offs, mask=valid, other=float("-inf"))
        indices = tl.load(chunk_index + row * NUM_CHUNKS + offs, mask=valid, other=2**31 - 1)
        best = tl.max(values, 0)
        # The first chunk with the maximum holds its first occurrence (chunks are in order).
        candidates = tl.where(valid & (values == best), indices, 2**31 - 1)
        tl.store(out + row, tl.min(candidates, 0).to(tl.int64))


def chunked_argmax(x: torch.Tensor) -> torch.Tensor:
    """The two-kernel argmax over the last dim of a 2-D tensor (any device Triton runs on)."""
    rows, cols = x.shape
    assert x.stride(1) == 1 and cols < 2**31
    num_chunks = max(1, min(MAX_CHUNKS, cols // MIN_CHUNK))
    chunk = triton.cdiv(triton.cdiv(cols, num_chunks), BLOCK) * BLOCK
    num_chunks = triton.cdiv(cols, chunk)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    chunk_index = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _chunk_max_kernel[(rows, num_chunks)](x, chunk_max, chunk_index, cols, x.stride(0),
                                          CHUNK=chunk, NUM_CHUNKS=num_chunks, BLOCK=BLOCK,
                                          num_warps=4, **launch_options(x.device))
    _pick_chunk_kernel[(rows,)](chunk_max, chunk_index, out, NUM_CHUNKS=num_chunks,
                                BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=1,
                                **launch_options(x.device))
    return out
