"""The chunked greedy argmax (engine/layers/argmax.py) against torch.argmax: the first maximum's
index, whatever the chunking (the interpreter on the CPU; real vocabularies on a GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specserve.engine.layers.argmax import argmax_last_dim, chunked_argmax  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("rows,cols", [(1, 5), (3, 1000), (2, 4096 + 7), (4, 9000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_argmax(rows, cols, dtype):
    gen = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    assert torch.equal(chunked_argmax(x.to(DEVICE)).cpu(), torch.argmax(x, -1))


def test_ties_pick_the_first_maximum_within_and_across_chunks():
    cols = 9000  # several chunks of 2048+ columns, several 1024-column blocks a chunk
    x = torch.full((4, cols), -3.0)
    x[0, [17, 900, 5000]] = 2.0            # within a block, across blocks and chunks
    x[1, [8999, 4100, 6000]] = 1.0         # the first is in the middle chunk
    x[2, :] = 0.5                          # every column ties
    x[3, [1023, 1024]] = 7.0               # across a block edge
    assert chunked_argmax(x.to(DEVICE)).cpu().tolist() == [17, 4100, 0, 1023]
    assert torch.equal(chunked_argmax(x.to(DEVICE)).cpu(), torch.argmax(x, -1))


def test_rows_of_minus_infinity_and_masked_tails():
    x = torch.full((3, 5000), float("-inf"))
    x[1, 4999] = -1e30                     # the last column of a ragged last chunk
    x[2, 2500:] = 0.0                      # a whole leading chunk banned
    assert chunked_argmax(x.to(DEVICE)).cpu().tolist() == torch.argmax(x, -1).tolist() == [0, 4999, 2500]


def test_dispatch_keeps_torch_off_cuda():
    x = torch.randn(2, 300)
    assert torch.equal(argmax_last_dim(x), torch.argmax(x, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 64, 512])
def test_gpu_real_vocabulary(rows):
    x = torch.randn(rows, 128256, device="cuda")
    x[:, 77] = x.max() + 1  # a tie-free maximum early, then a tie later in some rows
    x[::2, 100000] = x[::2, 77]
    assert torch.equal(argmax_last_dim(x), torch.argmax(x, -1))
    assert torch.equal(argmax_last_dim(x.bfloat16()), torch.argmax(x.bfloat16(), -1))
