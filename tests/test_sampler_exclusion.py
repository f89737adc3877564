"""A sampled token is never one the sampler excluded ([E27]): the hash noise lies strictly inside
(0, 1) over its whole domain, draws on a 128k vocabulary under every truncation and a grammar
mask never leave the allowed set, and a grammar's excluded tokens never appear among the
top_logprobs alternatives (their -inf has no JSON form)."""
from __future__ import annotations

import pytest
import torch

from helpers import make_predictable_pair
from specserve.engine import GrammarSpec, SamplingParams
from specserve.engine.layers.sampler import (UNIFORM_BITS, SamplingInfo, sample, uniform_from_bits,
                                             uniform_noise)

VOCAB = 131072  # Llama 3's vocabulary: the old noise hit 1.0 at V / 2^24 = 0.78 % of tokens
EOS = 2  # helpers.save_byte_tokenizer
# (seed, position) rows where the old 24-bit noise rounded to exactly 1.0 in some column of a
# 128k row (found by scanning it): each drew a probability-0 token there.
OLD_NOISE_ONES = [(9, 57), (9, 69), (9, 83), (5, 59), (1234, 47), (1234, 126)]


def test_noise_is_strictly_inside_the_unit_interval_for_every_hash():
    """Every value the kept bits can take (the whole domain, not a sample), with the bits the
    mapping drops set to ones: u in (0, 1), exponential noise -log(u) > 0, no two equal."""
    k = torch.arange(1 << UNIFORM_BITS, dtype=torch.int64)
    bits = (k << (64 - UNIFORM_BITS)) | ((1 << (64 - UNIFORM_BITS)) - 1)
    u = uniform_from_bits(bits)
    assert u.dtype == torch.float32
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    assert (-torch.log(u)).min().item() > 0.0
    assert bool((u[1:] > u[:-1]).all())  # exact: strictly increasing, none rounded together


def test_noise_rows_are_the_kept_bits_of_the_hash():
    """uniform_noise goes through the same mapping: the old rows that held an exact 1.0 now
    stay below it, and the values are still a pure function of (seed, position, column)."""
    seeds = torch.tensor([s for s, _ in OLD_NOISE_ONES])
    positions = torch.tensor([p for _, p in OLD_NOISE_ONES])
    u = uniform_noise(seeds, positions, VOCAB)
    assert u.max().item() < 1.0 and u.min().item() > 0.0
    torch.testing.assert_close(u, uniform_noise(seeds, positions, VOCAB), rtol=0, atol=0)


def _sampling_info(params: list[SamplingParams], seeds: list[int]) -> SamplingInfo:
    return SamplingInfo.build(params, seeds, [0] * len(params), [], VOCAB, "cpu")


@pytest.mark.parametrize("rule", ["top_k", "top_p", "min_p", "mask"])
def test_draws_on_a_large_vocabulary_stay_in_the_allowed_set(rule):
    """128k logits, each truncation rule (and a grammar-style -inf mask keeping 2 % of the
    vocabulary) over many seeds, the old noise's 1.0 rows included: no excluded token, ever."""
    gen = torch.Generator().manual_seed(0)
    rows = [(s, p) for s, p in OLD_NOISE_ONES] + [(1000 + i, 7 * i) for i in range(58)]
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 3
    params = {"top_k": SamplingParams(temperature=1.0, top_k=2),
              "top_p": SamplingParams(temperature=0.8, top_p=0.3),
              "min_p": SamplingParams(temperature=1.0, min_p=0.2),
              "mask": SamplingParams(temperature=1.0)}[rule]
    if rule == "mask":
        allowed = torch.rand(len(rows), VOCAB, generator=gen) < 0.02
        logits = logits.masked_fill(~allowed, float("-inf"))
    info = _sampling_info([params] * len(rows), [s for s, _ in rows])
    positions = torch.tensor([p for _, p in rows])
    tokens = sample(logits, info, torch.arange(len(rows)), positions).tokens
    if rule == "top_k":
        allowed = torch.zeros_like(logits, dtype=torch.bool).scatter_(
            1, logits.topk(2, dim=1).indices, True)
    elif rule == "top_p":
        probs = torch.softmax(logits / 0.8, dim=1)
        sorted_p, order = probs.sort(dim=1, descending=True)
        keep = (sorted_p.cumsum(1) - sorted_p) <= 0.3
        allowed = torch.zeros_like(keep).scatter_(1, order, keep)
    elif rule == "min_p":
        probs = torch.softmax(logits, dim=1)
        allowed = probs >= 0.2 * probs.max(dim=1, keepdim=True).values
    assert bool(allowed.gather(1, tokens.unsqueeze(1)).all()), tokens


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.mark.parametrize("overlap", [True, False])
def test_grammar_sampled_with_top_logprobs_lists_allowed_tokens(pair, make_engine, overlap):
    """Sampled under a grammar with top_logprobs wider than what it allows at most steps: the
    output is the grammar's, it stops, and the alternatives list only allowed tokens (no
    -inf, which has no JSON form)."""
    engine = make_engine(pair[0], enable_overlap=overlap)
    outs = engine.generate(prompt_token_ids=[[5, 6, 7]] * 4, sampling=[SamplingParams(
        max_new_tokens=12, temperature=1.0, seed=seed, logprobs=True,
        top_logprobs=5, grammar=GrammarSpec("regex", "(yes|no)!")) for seed in range(4)])
    for out in outs:
        assert out.text in ("yes!", "no!") and out.finish_reason == "stop"
        assert all(lp > float("-inf") for lp in out.logprobs)
        for top in out.top_logprobs:
            assert top and all(lp > float("-inf") for _, lp in top)


@pytest.mark.gpu
def test_a_million_draws_on_the_gpu_never_leave_the_top_k():
    """10^6 top-k=2 draws on a 128k vocabulary through the CUDA path (its chunked argmax): a
    per-token event of 1e-5 would show ~10 times (the old noise: ~7800)."""
    device = "cuda"
    rows, chunks = 1024, 977
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, VOCAB, generator=gen, device=device) * 3
    allowed = torch.zeros_like(logits, dtype=torch.bool).scatter_(
        1, logits.topk(2, dim=1).indices, True)
    info = SamplingInfo.build([SamplingParams(temperature=1.0, top_k=2)] * rows, [0] * rows,
                              [0] * rows, [], VOCAB, device)
    index = torch.arange(rows, device=device)
    outside = torch.zeros((), dtype=torch.int64, device=device)
    for chunk in range(chunks):
        info.seeds = index + chunk * rows  # a seed per draw
        tokens = sample(logits, info, index, index + chunk).tokens
        outside += (~allowed.gather(1, tokens.unsqueeze(1))).sum()
    assert outside.item() == 0
