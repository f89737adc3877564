"""Sampling on the device with no host synchronisation.

What a row samples from: the model's logits, then (in this order) the repetition penalty over
prompt and output, the presence and frequency penalties over output tokens, logit_bias, and the
min_new_tokens ban on stop ids; then temperature and top-k / top-p / min-p. Log-probabilities
(the chosen token's and the top_logprobs alternatives) are the log-softmax of that adjusted
distribution before temperature and truncation, for greedy and sampled rows alike.

Randomness is counter-based: the uniform for (request seed, sequence position, vocab id) is a
hash, not a draw from a stateful generator. So a seeded request samples the same tokens
whatever else is in its batch, after a retraction, and under speculative decoding; and a batch
is drawn a chunk of rows at a time (draw()), which bounds the draw's memory whatever its rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from specserve.engine.config import SamplingParams
from specserve.engine.host_copy import to_device
from specserve.engine.layers.argmax import argmax_last_dim

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)   # splitmix64 constants as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _xorshift_(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x ^= x >>> shift (a logical shift: the arithmetic one's sign bits masked off), in place."""
    return x.bitwise_xor_((x >> shift).bitwise_and_((1 << (64 - shift)) - 1))


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64, in place on `x` (a tensor of the caller's own): one
    temporary of x's size at a time."""
    _xorshift_(x, 30).mul_(_M1)
    _xorshift_(x, 27).mul_(_M2)
    return _xorshift_(x, 31)


# Bits of the hash a uniform keeps. (k + 0.5) / 2^23 is exact in float32 for every k < 2^23
# (k + 0.5 needs 24 significant bits), so u lies in [2^-24, 1 - 2^-24]: never 0 (log 0 = -inf)
# and never 1 (an exponential noise of -0.0, which makes a probability-0 token score 0 / -0 =
# NaN, and argmax picks the NaN). With 24 bits, k = 2^24 - 1 rounded up to exactly 1.0.
UNIFORM_BITS = 23


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 U(0,1), strictly inside, from the top UNIFORM_BITS bits of int64 hashes."""
    k = (bits >> (64 - UNIFORM_BITS)).bitwise_and_((1 << UNIFORM_BITS) - 1)
    u = k.float()
    del k
    return u.add_(0.5).mul_(1.0 / (1 << UNIFORM_BITS))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, width: int, salt: int = 0):
    """U(0,1) float32 of shape [N, width], a pure function of (seed, position, column, salt)."""
    base = _mix64_(seeds * _GOLDEN + positions * 0x2545F491 + salt)
    cols = torch.arange(width, device=seeds.device, dtype=torch.int64)
    return uniform_from_bits(_mix64_(base.unsqueeze(1) + cols * _GOLDEN))


class TokenHistory(NamedTuple):
    """Per logits row, what the penalties read: the tokens in the sequence (prompt and output,
    the repetition penalty) and how often each token was generated (the presence and frequency
    penalties). Under speculation a draft node's row includes its own draft ancestors."""

    in_sequence: torch.Tensor    # [N, V] bool
    output_counts: torch.Tensor  # [N, V] int32


class TokenChoice(NamedTuple):
    tokens: torch.Tensor                  # [N] int64
    logprobs: Optional[torch.Tensor]      # [N] float32, when some row asked for them
    top_ids: Optional[torch.Tensor]       # [N, K] int64, K the batch's largest top_logprobs
    top_logprobs: Optional[torch.Tensor]  # [N, K] float32


@dataclass
class SamplingInfo:
    """Per-request sampling tensors of a batch, on the device, built once per batch change."""

    temperatures: torch.Tensor     # [bs] float32 (1.0 for greedy rows, unused there)
    top_ks: torch.Tensor           # [bs] int64, vocab size when off
    top_ps: torch.Tensor           # [bs] float32
    min_ps: torch.Tensor           # [bs] float32
    rep_penalties: torch.Tensor    # [bs] float32
    presence_penalties: torch.Tensor   # [bs] float32
    frequency_penalties: torch.Tensor  # [bs] float32
    logit_bias: Optional[torch.Tensor]  # [bs, V] float32, when some request has one
    seeds: torch.Tensor            # [bs] int64
    is_greedy: torch.Tensor        # [bs] bool
    stop_ids: torch.Tensor         # [bs, S] int64, -1 padded: EOS (unless ignore_eos) + stop ids
    min_output_pos: torch.Tensor   # [bs] int64: stop ids banned at positions below this
    all_greedy: bool
    any_filter: bool               # top-k / top-p / min-p somewhere
    any_penalty: bool              # a repetition, presence or frequency penalty somewhere
    any_min_new: bool
    any_logprobs: bool
    max_top_logprobs: int          # the batch's largest top_logprobs (0: none)

    @staticmethod
    def build(params: Sequence[SamplingParams], seeds: Sequence[int], prompt_lens: Sequence[int],
              eos_ids: Sequence[int], vocab_size: int, device) -> "SamplingInfo":
        def t(values, dtype):  # pinned on CUDA: a batch change copies a dozen of these
            return to_device(values, dtype, device)

        stops = [list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids)) for p in params]
        width = max((len(s) for s in stops), default=0) or 1
        greedy = [p.is_greedy for p in params]
        logit_bias = None
        if any(p.logit_bias for p in params):
            # Built on the device from the few (row, id, bias) triples: a dense host tensor
            # would copy bs * V floats at every batch change.
            triples = [(b, t, v) for b, p in enumerate(params) for t, v in p.logit_bias]
            rows, ids, values = zip(*triples)
            logit_bias = torch.zeros((len(params), vocab_size), dtype=torch.float32, device=device)
            logit_bias[t(rows, torch.int64), t(ids, torch.int64)] = t(values, torch.float32)
        return SamplingInfo(
            temperatures=t([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            top_ks=t([vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params], torch.int64),
            top_ps=t([p.top_p for p in params], torch.float32),
            min_ps=t([p.min_p for p in params], torch.float32),
            rep_penalties=t([p.repetition_penalty for p in params], torch.float32),
            presence_penalties=t([p.presence_penalty for p in params], torch.float32),
            frequency_penalties=t([p.frequency_penalty for p in params], torch.float32),
            logit_bias=logit_bias,
            seeds=t(list(seeds), torch.int64),
            is_greedy=t(greedy, torch.bool),
            stop_ids=t([s + [-1] * (width - len(s)) for s in stops], torch.int64),
            min_output_pos=t([n + p.min_new_tokens for p, n in zip(params, prompt_lens)], torch.int64),
            all_greedy=all(greedy),
            any_filter=any(not g and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)
                           for p, g in zip(params, greedy)),
            any_penalty=any(p.penalises_repeats for p in params),
            any_min_new=any(p.min_new_tokens > 0 for p in params),
            any_logprobs=any(p.logprobs for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
        )

    @property
    def per_token_rules(self) -> bool:
        """Whether a step needs more than the argmax (what CUDA graphs capture)."""
        return (not self.all_greedy or self.any_penalty or self.any_min_new or self.any_logprobs
                or self.logit_bias is not None)


# --- CUDA graphs of sampled steps ---------------------------------------------------------------
# A graph replays the ops it was captured with, so a captured variant fixes the host flags of its
# SamplingInfo; its per-row tensors are static buffers that each replay refills. Variants:
GREEDY, SAMPLED, FILTERED = "greedy", "sampled", "filtered"
# What sample() reads per row when the only rules are temperature / top-k / top-p / min-p, and
# what rows past the batch hold (greedy: their argmax, which nobody reads; no NaN on the way).
GRAPH_SAMPLING_PAD = {"temperatures": 1.0, "top_ks": 1, "top_ps": 1.0, "min_ps": 0.0, "seeds": 0,
                      "is_greedy": True}


def graph_variant(info: SamplingInfo) -> Optional[str]:
    """Which captured variant runs exactly the ops sample() runs for this batch: GREEDY (the
    argmax), SAMPLED (temperature), FILTERED (temperature and top-k/top-p/min-p), or None when
    a rule stays eager (penalties, logit_bias, min_new_tokens, logprobs)."""
    if info.any_penalty or info.any_min_new or info.any_logprobs or info.logit_bias is not None:
        return None
    if info.all_greedy:
        return GREEDY
    return FILTERED if info.any_filter else SAMPLED


def graph_sampling_info(bs: int, vocab_size: int, device, variant: str) -> SamplingInfo:
    """The SamplingInfo a variant is captured with: its flags, and per-row buffers that
    load_graph_sampling() refills before each replay."""
    from specserve.engine.config import SamplingParams

    params = SamplingParams(temperature=0.0) if variant == GREEDY else \
        SamplingParams(temperature=1.0, top_p=0.5 if variant == FILTERED else 1.0)
    info = SamplingInfo.build([params] * bs, [0] * bs, [0] * bs, [], vocab_size, device)
    assert graph_variant(info) == variant
    return info


def load_graph_sampling(static: SamplingInfo, live: SamplingInfo, bs: int) -> None:
    """Copy a batch's per-row sampling tensors into a captured variant's buffers (rows past
    bs: GRAPH_SAMPLING_PAD)."""
    for name, pad in GRAPH_SAMPLING_PAD.items():
        buf = getattr(static, name)
        buf[:bs].copy_(getattr(live, name), non_blocking=True)
        buf[bs:].fill_(pad)


def adjust_logits(logits: torch.Tensor, info: SamplingInfo, rows: torch.Tensor,
                  positions: torch.Tensor, history: Optional[TokenHistory]) -> torch.Tensor:
    """Rules that change which tokens may come next: penalties, logit_bias, min_new_tokens.

    rows: [N] request index of each logits row; positions: [N] sequence index of the token
    being chosen; history: the tokens each row's sequence holds (penalties only).
    """
    if info.any_penalty and history is not None:
        penalty = info.rep_penalties[rows].unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(history.in_sequence, penalised, logits)
        counts = history.output_counts.to(logits.dtype)
        logits = (logits - info.frequency_penalties[rows].unsqueeze(1) * counts
                  - info.presence_penalties[rows].unsqueeze(1) * (counts > 0))
    if info.logit_bias is not None:
        logits = logits + info.logit_bias[rows]
    if info.any_min_new:
        banned = (positions < info.min_output_pos[rows]).unsqueeze(1)
        stop = info.stop_ids[rows]
        ban_mask = torch.zeros_like(logits, dtype=torch.bool)
        ban_mask.scatter_(1, stop.clamp(min=0), (stop >= 0) & banned)
        logits = logits.masked_fill(ban_mask, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, info: SamplingInfo, rows: torch.Tensor) -> torch.Tensor:
    """The distribution a non-greedy row samples from: temperature, then top-k/top-p/min-p."""
    probs = torch.softmax(logits / info.temperatures[rows].unsqueeze(1), dim=-1)
    if not info.any_filter:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    drop = rank >= info.top_ks[rows].unsqueeze(1)
    drop |= (sorted_p.cumsum(-1) - sorted_p) > info.top_ps[rows].unsqueeze(1)
    drop |= sorted_p < info.min_ps[rows].unsqueeze(1) * sorted_p[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      salt: int = 0) -> torch.Tensor:
    """Exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) from the hash noise."""
    noise = uniform_noise(seeds, positions, probs.shape[1], salt).log_().neg_()
    return argmax_last_dim(torch.div(probs, noise, out=noise))


# The draw's work is [rows, vocab]: probabilities (and the filter's sort), then the noise's int64
# hash bits with a temporary beside them. For a tree verify's 2048 rows of a 128k vocabulary that
# was 6.9 GiB at once, which the KV pool's sizing left no room for. So rows are drawn a chunk of
# about DRAW_CHUNK_ELEMENTS at a time (32 rows of a 128k vocabulary: ~100 MB); a row's draw is a
# function of its own row only, the same in any chunk.
DRAW_CHUNK_ELEMENTS = 1 << 22
# Bounds on what a draw allocates at once, for the KV pool's sizing (builder.py): per element
# of a chunk (measured: 24 bytes with temperature only, 25 with the top-k/top-p/min-p filter
# on the CPU; on an H100 the filter's sort takes ~48: its sorted values, int64 indices and
# workspace; tests/test_sampler_memory.py), and per row of the batch (its seeds, draws and
# tokens, and the chunked argmax's per-row partial maxima on CUDA).
DRAW_BYTES_PER_ELEMENT = 64
DRAW_BYTES_PER_ROW = 1024


def draw_chunk_rows(vocab_size: int) -> int:
    return max(1, DRAW_CHUNK_ELEMENTS // vocab_size)


def draw_workspace_bytes(rows: int, vocab_size: int) -> int:
    """A bound on the bytes sample() allocates besides its logits to draw `rows` rows."""
    chunk = min(rows, draw_chunk_rows(vocab_size))
    return chunk * vocab_size * DRAW_BYTES_PER_ELEMENT + rows * DRAW_BYTES_PER_ROW


def draw(logits: torch.Tensor, info: SamplingInfo, rows: torch.Tensor,
         positions: torch.Tensor) -> torch.Tensor:
    """Every row's seeded draw from its target_probs, draw_chunk_rows() rows at a time."""
    step = draw_chunk_rows(logits.shape[1])
    seeds = info.seeds[rows]
    draws = [sample_from_probs(target_probs(logits[i:i + step], info, rows[i:i + step]),
                               seeds[i:i + step], positions[i:i + step])
             for i in range(0, max(1, logits.shape[0]), step)]  # no rows: one empty chunk
    return draws[0] if len(draws) == 1 else torch.cat(draws)


def sample(logits: torch.Tensor, info: SamplingInfo, rows: torch.Tensor, positions: torch.Tensor,
           history: Optional[TokenHistory] = None) -> TokenChoice:
    """Choose one token per logits row, with its log-probability and the top alternatives
    when the batch asks for them."""
    logits = adjust_logits(logits, info, rows, positions, history)
    tokens = argmax_last_dim(logits)
    if not info.all_greedy:
        tokens = torch.where(info.is_greedy[rows], tokens, draw(logits, info, rows, positions))
    if not info.any_logprobs:
        return TokenChoice(tokens, None, None, None)
    all_logprobs = torch.log_softmax(logits, dim=-1)
    logprobs = all_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_ids = top = None
    if info.max_top_logprobs:
        top, top_ids = all_logprobs.topk(min(info.max_top_logprobs, logits.shape[1]), dim=-1)
    return TokenChoice(tokens, logprobs, top_ids, top)


def draft_topk(logits: torch.Tensor, k: int, with_probs: bool = True):
    """A draft head's k most likely next tokens: (probabilities [n, k] or None, ids [n, k]).

    With k = 1 and no probabilities asked for (chain drafting), the argmax of the logits,
    which is the softmax's own argmax, without the softmax over the draft vocabulary."""
    if k == 1 and not with_probs:
        return None, argmax_last_dim(logits).unsqueeze(1)
    probs = torch.softmax(logits.float(), dim=-1)
    return probs.topk(k, dim=-1) if k > 1 else probs.max(dim=-1, keepdim=True)


def scored_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """Prompt scoring: the log-probability of each row's target token under the model's own
    distribution (no sampling rules), and the k most likely tokens (None when k is 0)."""
    all_logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = all_logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    if not k:
        return chosen, None, None
    top, top_ids = all_logprobs.topk(min(k, logits.shape[1]), dim=-1)
    return chosen, top_ids, top
