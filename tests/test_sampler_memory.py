"""The seeded draw's memory: a batch is drawn a chunk of rows at a time, so what sample() holds
at once is bounded by a chunk, not by rows x vocab (a tree verify's 2048 rows of a 128k
vocabulary held 6.9 GiB of probabilities and int64 noise and ran a CUDA graph capture out of
memory); the draws stay the hash's, the same in any chunking. Peaks are measured on the meta
device (tests/peak_bytes.py), and on a GPU with the caching allocator's own count."""
from __future__ import annotations

import pytest
import torch

from peak_bytes import PeakBytes
from specserve.engine.config import SamplingParams
from specserve.engine.grammar.bitmask import apply_token_bitmask, bitmask_width, bitmask_workspace_bytes
from specserve.engine.layers import sampler
from specserve.engine.layers.sampler import (SamplingInfo, draw_chunk_rows, draw_workspace_bytes, sample,
                                             sample_from_probs, target_probs, uniform_noise)

LLAMA3_VOCAB = 128256
TREE_ROWS = 256 * 8  # max_running_requests 256 x num_draft_tokens 8: one verify's logit rows
VARIANTS = {"sampled": SamplingParams(temperature=0.8),
            "filtered": SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.01)}

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _reference_uniform(seed: int, position: int, column: int, salt: int) -> float:
    """The noise as it was defined before the draw was chunked, in Python's integers: the top 23
    bits of splitmix64(splitmix64(seed * G + position * C + salt) + column * G), centred."""
    base = _splitmix64(seed * _GOLDEN + position * 0x2545F491 + salt)
    return ((_splitmix64(base + column * _GOLDEN) >> 41) + 0.5) / (1 << 23)


def test_the_noise_is_the_same_hash_of_seed_position_and_column():
    """Every draw of a seeded request stays what it was: the in-place hash equals the reference
    bit for bit, over seeds at the int64 edges, high positions and the last column."""
    seeds = [0, 1, 9, 1234, 2 ** 62 + 7, 2 ** 63 - 1]
    positions = [0, 5, 57, 1000, 4095, 131071]
    columns = [0, 1, 2, 100, 65535, LLAMA3_VOCAB - 1]
    for salt in (0, 3):
        u = uniform_noise(torch.tensor(seeds), torch.tensor(positions), LLAMA3_VOCAB, salt)
        got = [[u[r, c].item() for c in columns] for r in range(len(seeds))]
        assert got == [[_reference_uniform(s, p, c, salt) for c in columns]
                       for s, p in zip(seeds, positions)]


def _batch(variant: str, n: int, vocab: int, device="cpu"):
    """n rows of logits, every third greedy, the rest `variant`, each its own seed."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(device)
    params = [SamplingParams(temperature=0.0) if i % 3 == 2 else VARIANTS[variant] for i in range(n)]
    info = SamplingInfo.build(params, [100 + i for i in range(n)], [0] * n, [], vocab, device)
    rows = torch.arange(n, device=device)
    return logits, info, rows, rows * 5 + 11


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_draw_is_the_same_in_any_chunking(monkeypatch, variant):
    """One row a chunk, three (the last chunk short), or the whole batch at once: the same
    tokens, and the whole batch's are the exponential race over every row at once (the
    unchunked draw)."""
    n, vocab = 10, 5000
    logits, info, rows, positions = _batch(variant, n, vocab)
    race = sample_from_probs(target_probs(logits, info, rows), info.seeds, positions)
    expected = torch.where(info.is_greedy, logits.argmax(-1), race)
    for chunk_rows in (1, 3, n, 4 * n):
        monkeypatch.setattr(sampler, "DRAW_CHUNK_ELEMENTS", chunk_rows * vocab)
        assert draw_chunk_rows(vocab) == chunk_rows
        assert torch.equal(sample(logits, info, rows, positions).tokens, expected), chunk_rows
    assert not torch.equal(race, logits.argmax(-1))  # sampled rows do not all draw the argmax


def test_a_batch_of_no_rows_draws_nothing():
    logits, info, rows, positions = _batch("filtered", 0, 5000)
    assert sample(logits, info, rows, positions).tokens.shape == (0,)


def _peak(fn) -> int:
    with PeakBytes() as measured:
        fn()
    return measured.peak


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drawing_a_tree_verify_holds_one_chunk_not_the_batch(variant):
    """2048 rows of a 128k vocabulary (meta tensors: nothing is allocated): the draw's peak is
    within draw_workspace_bytes, a few percent of one float32 copy of the logits (the unchunked
    draw held 28 bytes an element: 6.9 GiB), and the same for a batch 8 times smaller."""
    peaks = {}
    for n in (TREE_ROWS // 8, TREE_ROWS):
        logits = torch.empty(n, LLAMA3_VOCAB, device="meta")
        params = [VARIANTS[variant]] * n
        info = SamplingInfo.build(params, list(range(n)), [0] * n, [], LLAMA3_VOCAB, "meta")
        rows = torch.arange(n, device="meta")
        peaks[n] = _peak(lambda: sample(logits, info, rows, rows + 1))
        assert peaks[n] <= draw_workspace_bytes(n, LLAMA3_VOCAB)
    chunk_elements = draw_chunk_rows(LLAMA3_VOCAB) * LLAMA3_VOCAB
    assert peaks[TREE_ROWS] >= 16 * chunk_elements  # the bound is not loose by more than 2x
    assert peaks[TREE_ROWS] < TREE_ROWS * LLAMA3_VOCAB * 4 / 8
    more_rows = TREE_ROWS - TREE_ROWS // 8
    assert peaks[TREE_ROWS] - peaks[TREE_ROWS // 8] <= more_rows * sampler.DRAW_BYTES_PER_ROW


def test_masking_a_tree_verify_stays_within_its_bound():
    logits = torch.empty(TREE_ROWS, LLAMA3_VOCAB, device="meta")
    mask = torch.empty(TREE_ROWS, bitmask_width(LLAMA3_VOCAB), dtype=torch.int32, device="meta")
    peak = _peak(lambda: apply_token_bitmask(logits, mask))
    assert TREE_ROWS * LLAMA3_VOCAB * 4 < peak <= bitmask_workspace_bytes(TREE_ROWS, LLAMA3_VOCAB)


def test_the_bounds_grow_with_rows_and_vocabulary_as_documented():
    chunk = draw_chunk_rows(LLAMA3_VOCAB)
    assert chunk == (1 << 22) // LLAMA3_VOCAB == 32
    assert draw_workspace_bytes(TREE_ROWS, LLAMA3_VOCAB) == 32 * LLAMA3_VOCAB * 64 + TREE_ROWS * 1024
    assert draw_workspace_bytes(1, LLAMA3_VOCAB) == LLAMA3_VOCAB * 64 + 1024  # a chunk of one row
    assert draw_chunk_rows(1 << 23) == 1  # a vocabulary wider than a chunk: a row at a time
    assert bitmask_workspace_bytes(TREE_ROWS, LLAMA3_VOCAB) == (TREE_ROWS * LLAMA3_VOCAB + 32) * 8
    assert bitmask_workspace_bytes(1, 100) == (128 + 32) * 8  # whole 32-bit words


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_draw_and_mask_peaks_stay_within_their_bounds(variant):
    """The caching allocator's own peak on a tree verify's 2048 x 128k logits (the chunked
    argmax's buffers included), alone and after a grammar's mask; the draws equal the unchunked
    race over the whole batch (CUDA's softmax, sort and cumsum are per row)."""
    logits, info, rows, positions = _batch(variant, TREE_ROWS, LLAMA3_VOCAB, "cuda")
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (TREE_ROWS, bitmask_width(LLAMA3_VOCAB)),
                         dtype=torch.int32, device="cuda")

    def peak(fn) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        return torch.cuda.max_memory_allocated() - before

    tokens = []
    assert peak(lambda: tokens.append(sample(logits, info, rows, positions).tokens)) \
        <= draw_workspace_bytes(TREE_ROWS, LLAMA3_VOCAB)
    assert peak(lambda: sample(apply_token_bitmask(logits, mask), info, rows, positions)) \
        <= bitmask_workspace_bytes(TREE_ROWS, LLAMA3_VOCAB) + draw_workspace_bytes(TREE_ROWS, LLAMA3_VOCAB)
    race = sample_from_probs(target_probs(logits, info, rows), info.seeds, positions)
    assert torch.equal(tokens[0], torch.where(info.is_greedy, logits.argmax(-1), race))
