"""CUDA graphs of short extends: one request's last prefill chunk of at most
`MAX_SHORT_EXTEND` tokens, replayed instead of launched kernel by kernel.

A prompt whose prefix the radix cache holds prefills only its tail (tens of tokens), and so
does a short prompt; eagerly that forward is hundreds of host launches (a few milliseconds for
an 8B model, most of the time to first token of a cached 4k prompt). Each bucket of tail
lengths (8, 16, 32, 64 tokens: with a draft model the cache keeps one token less of a
prompt, so a 32-token tail extends 33) is captured once for one request: the chunk's
tokens, positions and KV slots padded to the bucket (padding: token 0 at position 0 into the dummy KV slot 0, after
every real token, so no real token attends to it), and a 4-vector (row, prefix length, real
length, index of the last real token) that every length-dependent step reads on the device.
Backends that build their metadata on the device from bounds (Triton) capture the extend as
they capture verify; the sampled token is the argmax (graphs cover greedy steps without
per-token rules or prompt logprobs, as decode graphs do).

The host fills one pinned buffer (ids, positions, EAGLE's shifted ids, the 4-vector) and the
replay copies it and the slots into the static inputs: three copies, then the graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from specserve.engine.runtime.step import ExtendStep

SHORT_EXTEND_BUCKETS = (8, 16, 32, 64)
MAX_SHORT_EXTEND = SHORT_EXTEND_BUCKETS[-1]


class ShortExtendInputs(NamedTuple):
    """The static inputs of a captured short extend (views of one packed buffer, and the slots)."""

    ids: torch.Tensor         # [L] the chunk's tokens, then padding
    positions: torch.Tensor   # [L]
    shifted: torch.Tensor     # [L] EAGLE: token p + 1 for position p (the last one is sampled)
    meta: torch.Tensor        # [4] row, prefix length, real length, index of the last real token
    loc: torch.Tensor         # [L] KV slots (padding: slot 0)
    packed: torch.Tensor      # [3L + 4] ids | positions | shifted | meta: one host-to-device copy

    @property
    def row(self) -> torch.Tensor:
        return self.meta[0:1]

    @property
    def prefix_len(self) -> torch.Tensor:
        return self.meta[1:2]

    @property
    def seq_len(self) -> torch.Tensor:
        return self.meta[1:2] + self.meta[2:3]

    @property
    def last(self) -> torch.Tensor:
        return self.meta[3:4]


def make_short_extend_inputs(length: int, device: torch.device) -> ShortExtendInputs:
    """Static inputs of one bucket, holding a valid extend of `length` tokens on row 0."""
    packed = torch.zeros(3 * length + 4, dtype=torch.int64, device=device)
    ids, positions, shifted, meta = packed.split([length, length, length, 4])
    meta.copy_(torch.tensor([0, 0, length, length - 1]))
    return ShortExtendInputs(ids, positions, shifted, meta,
                             torch.zeros(length, dtype=torch.int64, device=device), packed)


def fits_short_extend(step: ExtendStep) -> bool:
    """One request ending its prefill with a short chunk, greedy, no prompt logprobs, no grammar."""
    if len(step.rows) != 1 or not step.samples[0] or step.prompt_spans[0] is not None:
        return False
    start, end = step.chunks[0]
    return (end - start <= MAX_SHORT_EXTEND and not step.sampling.per_token_rules
            and step.grammar is None)


def pack_short_extend(step: ExtendStep, bucket: int, next_tokens: bool) -> torch.Tensor:
    """The host side of one replay: the packed buffer's values for `step` in a bucket (pinned).
    `next_tokens`: also EAGLE's shifted ids (token p + 1 for each position p of the chunk)."""
    (start, end), fill, row = step.chunks[0], step.fill_ids[0], step.rows[0]
    n = end - start
    pad = [0] * (bucket - n)
    shifted = fill[start + 1:end] + [0] + pad if next_tokens else [0] * bucket
    values = fill[start:end] + pad + list(range(start, end)) + pad + shifted + [row, start, n, n - 1]
    return torch.tensor(values, dtype=torch.int64, pin_memory=torch.cuda.is_available())


def load_short_extend(static: ShortExtendInputs, packed: torch.Tensor, loc: torch.Tensor) -> None:
    """Copy one replay's inputs into a bucket's static buffers (on the forward stream)."""
    static.packed.copy_(packed, non_blocking=True)
    n = loc.shape[0]
    static.loc[:n].copy_(loc)
    static.loc[n:].zero_()
