"""CUDA graphs of extends: a batch of requests each ending its prefill with its chunk,
replayed instead of launched kernel by kernel.

Eagerly an extend is hundreds of host launches around a read of every weight: a few
milliseconds for an 8B model whatever its size, so the batches that concurrent arrivals make
(5-20 requests of 50-140 tokens) and a cached prompt's tail (tens of tokens) are bound by the
host, and decoding requests stall behind them. Each bucket is captured once:

* `tokens` T: the batch's chunks packed back to back, then padding up to T (64 ... 2048);
* `max_chunk` M: a bound on every request's chunk, the attention grid's per-request extent
  (64 runs the split extend over the prefix, as the eager path does for chunks of at most
  SPLIT_EXTEND_MAX_TOKENS: a cached prompt's tail over a long prefix; larger ones the plain
  extend, whose programs past a request's tokens exit at once);
* `requests` R: how many requests it samples (`MAX_REQUESTS`; also one, for a lone tail).

The attention sees E = R + ceil(T / P) entries (P = min(M, PAD_CHUNK)): the requests, then
the padding tokens in entries of their own of at most P tokens (pool row 0, no prefix), then
empty ones (row 0, nothing). Padding is token 0 at position 0 into the dummy KV slot 0: every
padding token computes the same finite values, and no real token attends to it. Every length
is on the device: per entry (row, prefix length, chunk length), per sampled request the index
of its last token; the kernels' grids depend on T, M and E only, which the bucket fixes.
Sampled entries past the batch point at token T - 1 and stash into row 0. The sampled token
is the argmax: graphs cover batches whose requests all end their prefill, greedy, without
per-token rules, prompt logprobs or a grammar, as decode graphs do; the rest runs eagerly.

The host fills one pinned buffer (ids, positions, EAGLE's shifted ids, the per-entry vectors)
and the replay copies it and the slots into the static inputs: three copies, then the graph.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from specserve.engine.runtime.step import ExtendStep

TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048)
MAX_REQUESTS = 32  # arrivals batch 5-20 requests; more run eagerly
SPLIT_CHUNK = 64  # attention/triton/backend.py SPLIT_EXTEND_MAX_TOKENS: chunks it runs split
PAD_CHUNK = 256  # padding entries' most tokens: padding attends (causally) within its entry


class ExtendBucket(NamedTuple):
    tokens: int      # T
    max_chunk: int   # M
    requests: int    # R

    @property
    def pad_chunk(self) -> int:
        return min(self.max_chunk, PAD_CHUNK)

    @property
    def entries(self) -> int:
        """The attention's batch: R requests, then room for up to T padding tokens."""
        return self.requests + -(-self.tokens // self.pad_chunk)


def extend_buckets(max_requests: int, width: int) -> list[ExtendBucket]:
    """The captured buckets, smallest first: per T, chunks of at most 64 (split extend) for
    T <= 256, of at most 256 (the arrivals' prompts) above, and of at most T; R requests, and
    one for the T = 64 bucket (a lone cached tail: no idle programs for absent requests).
    No chunk is longer than the rows' width, so that caps every bound."""
    requests = min(MAX_REQUESTS, max_requests)
    buckets = {ExtendBucket(TOKEN_BUCKETS[0], min(SPLIT_CHUNK, width), 1)}
    for tokens in TOKEN_BUCKETS:
        for max_chunk in (SPLIT_CHUNK if tokens <= 256 else 256, tokens):
            buckets.add(ExtendBucket(tokens, min(max_chunk, width), requests))
    return sorted(buckets)


def extend_bucket(step: ExtendStep, buckets: Sequence[ExtendBucket]) -> Optional[ExtendBucket]:
    """The smallest bucket of a batch whose requests all end their prefill with this chunk,
    greedy, no prompt logprobs, no grammar; None: the eager path."""
    if (not all(step.samples) or any(span is not None for span in step.prompt_spans)
            or step.sampling.per_token_rules or step.grammar is not None):
        return None
    lens = [end - start for start, end in step.chunks]
    total, longest = sum(lens), max(lens)
    return next((b for b in buckets if b.tokens >= total and b.max_chunk >= longest
                 and b.requests >= len(lens)), None)


class CapturedExtendInputs(NamedTuple):
    """The static inputs of a captured extend (views of one packed buffer, and the slots)."""

    ids: torch.Tensor          # [T] the chunks' tokens, then padding
    positions: torch.Tensor    # [T]
    shifted: torch.Tensor      # [T] EAGLE: token p + 1 for position p (a chunk's last is sampled)
    rows: torch.Tensor         # [E] request-table row per entry (padding: 0)
    prefix_lens: torch.Tensor  # [E]
    extend_lens: torch.Tensor  # [E] chunk lengths (padding entries: theirs; empty ones: 0)
    last: torch.Tensor         # [R] index of each sampled request's last token
    loc: torch.Tensor          # [T] KV slots (padding: slot 0)
    packed: torch.Tensor       # [3T + 3E + R] ids | positions | shifted | rows | prefix | lens | last
    max_chunk: int             # M: the host bound the attention's grid is sized by

    @property
    def sampled_rows(self) -> torch.Tensor:
        return self.rows[:self.last.shape[0]]

    @property
    def sampled_seq_lens(self) -> torch.Tensor:
        n = self.last.shape[0]
        return self.prefix_lens[:n] + self.extend_lens[:n]


def padding_entries(bucket: ExtendBucket, num_entries: int, pad: int) -> list[int]:
    """The lengths of the entries after `num_entries` real ones: `pad` padding tokens in
    entries of at most P tokens, then empty ones up to E."""
    P = bucket.pad_chunk
    pad_lens = [min(P, pad - i) for i in range(0, pad, P)]
    return pad_lens + [0] * (bucket.entries - num_entries - len(pad_lens))


def entry_lens(bucket: ExtendBucket, lens: list, pad: int) -> torch.Tensor:
    """[E] every entry's length: `lens` of the real ones, then `padding_entries` (pinned on CUDA
    hosts, for an asynchronous copy)."""
    return torch.tensor(lens + padding_entries(bucket, len(lens), pad), dtype=torch.int64,
                        pin_memory=torch.cuda.is_available())


def _pack(bucket: ExtendBucket, ids: list, positions: list, shifted: list, rows: list,
          prefix_lens: list, extend_lens: list, last: list) -> torch.Tensor:
    """The packed buffer of `bucket` for these requests (pinned on CUDA hosts)."""
    T, E = bucket.tokens, bucket.entries
    pad = T - len(ids)
    values = (ids + [0] * pad + positions + [0] * pad + shifted + [0] * (T - len(shifted))
              + rows + [0] * (E - len(rows)) + prefix_lens + [0] * (E - len(rows))
              + extend_lens + padding_entries(bucket, len(rows), pad)
              + last + [T - 1] * (bucket.requests - len(last)))
    return torch.tensor(values, dtype=torch.int64, pin_memory=torch.cuda.is_available())


def pack_captured_extend(step: ExtendStep, bucket: ExtendBucket, next_tokens: bool) -> torch.Tensor:
    """The host side of one replay: the packed buffer's values for `step` in `bucket`.
    `next_tokens`: also EAGLE's shifted ids (token p + 1 for each position p of a chunk)."""
    ids, positions, shifted, prefix_lens, extend_lens, last = [], [], [], [], [], []
    for fill, (start, end) in zip(step.fill_ids, step.chunks):
        ids += fill[start:end]
        positions += range(start, end)
        if next_tokens:  # the chunk ends the prefill: its last slot takes the sampled token
            shifted += fill[start + 1:end] + [0]
        prefix_lens.append(start)
        extend_lens.append(end - start)
        last.append(len(ids) - 1)
    return _pack(bucket, ids, positions, shifted, list(step.rows), prefix_lens, extend_lens, last)


def make_captured_extend_inputs(bucket: ExtendBucket, device: torch.device) -> CapturedExtendInputs:
    """Static inputs of one bucket, holding a valid extend of padding alone."""
    T, E = bucket.tokens, bucket.entries
    packed = _pack(bucket, [], [], [], [], [], [], []).to(device)
    views = packed.split([T, T, T, E, E, E, bucket.requests])
    return CapturedExtendInputs(*views, torch.zeros(T, dtype=torch.int64, device=device), packed,
                                bucket.max_chunk)


def load_captured_extend(static: CapturedExtendInputs, packed: torch.Tensor, loc: torch.Tensor) -> None:
    """Copy one replay's inputs into a bucket's static buffers (on the forward stream)."""
    static.packed.copy_(packed, non_blocking=True)
    n = loc.shape[0]
    static.loc[:n].copy_(loc)
    static.loc[n:].zero_()
