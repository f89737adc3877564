"""The mixed step's target forward: decode (or speculative verify) rows and prefill chunks in
one batch (scheduler/mixed_batch.py decides what rides; the workers' `launch_mixed` run it).

The batch is the decode rows, then the chunks, as one ragged extend: a decode row adds its
token (plain) or the verify's D nodes at its device-known length (tree-masked in tree mode), a
chunk its prompt tokens causally after its prefix. Its KV writes are each part's own slots in
that order. Logits are computed only for the rows that sample: every decode row's token (every
verify node), and each chunk's last token. Each part samples with its own SamplingInfo; a
seeded draw is keyed by (seed, position), so a row's token never depends on what rode with it.
Nothing here reads a device value on the host.

With CUDA graphs the target forward of a plain or chain mixed step is a replay of the same
layout as a captured ragged extend (runtime/captured_mixed.py, keyed by token count, chunk bound
and entries, not by decode batch x prompt tokens); the chunks' logits and sampling run as here,
and a chain step's draft, accept and draft-extends replay graphs too (spec/spec_worker.py).
Tree verify rows (their custom mask) and steps no bucket holds build this module's
ForwardBatch and run eagerly.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from specserve.engine.aranges import arange
from specserve.engine.forward_batch import ForwardBatch, ForwardMode, KVRows
from specserve.engine.layers.sampler import sample
from specserve.engine.runtime.step import StepResult


class DecodeRows(NamedTuple):
    """The decode (or verify) rows of a mixed forward: `width` new tokens each, flattened."""

    input_ids: torch.Tensor           # [bs * width] (resolved: no FutureMap sentinels)
    positions: torch.Tensor           # [bs * width]
    prefix_lens: torch.Tensor         # [bs] KV length before the step (device)
    out_cache_loc: torch.Tensor       # [bs * width] the slots their KV goes to
    width: int
    seq_lens_cpu: Optional[list[int]]  # prefix + width on the host, when a backend reads it
    mask: Optional[torch.Tensor] = None  # [bs, width, width] tree mask; None: causal


def mixed_forward_batch(rows: DecodeRows, chunks, kv: KVRows, max_seq_len: int,
                        aux_hidden_layers: tuple[int, ...] = ()) -> ForwardBatch:
    """The ForwardBatch of `rows` then `chunks` (a worker's extend ForwardInputs); `kv` maps
    them in that order; `max_seq_len` bounds every row's length after the step."""
    bs = rows.prefix_lens.shape[0]
    lens = [rows.width] * bs + list(chunks.extend_lens_cpu)
    host = rows.seq_lens_cpu is not None and chunks.seq_lens_cpu is not None
    return ForwardBatch(
        mode=ForwardMode.MIXED, input_ids=torch.cat([rows.input_ids, chunks.input_ids]),
        positions=torch.cat([rows.positions, chunks.positions]), kv_rows=kv,
        prefix_lens=torch.cat([rows.prefix_lens, chunks.prefix_lens]), extend_lens_cpu=lens,
        out_cache_loc=torch.cat([rows.out_cache_loc, chunks.out_cache_loc]),
        seq_lens_cpu=rows.seq_lens_cpu + chunks.seq_lens_cpu if host else None,
        max_seq_len=max_seq_len, custom_mask=_joined_mask(rows.mask, lens),
        aux_hidden_layers=aux_hidden_layers)


def _joined_mask(tree_mask: Optional[torch.Tensor], lens: list[int]) -> Optional[torch.Tensor]:
    """[bs, max_len, max_len]: the tree mask of the verify rows, causal for the chunks (None
    when the verify rows are causal too: chain mode)."""
    if tree_mask is None:
        return None
    rows, width = tree_mask.shape[0], tree_mask.shape[1]
    max_len = max(lens)
    causal = torch.ones((max_len, max_len), dtype=torch.bool, device=tree_mask.device).tril()
    mask = causal.expand(len(lens), max_len, max_len).clone()
    mask[:rows, :width, :width] = tree_mask  # past `width` a verify row has no query or key
    return mask


def logit_rows(num_row_tokens: int, chunks) -> torch.Tensor:
    """Indices (into the forward's tokens) of the rows that sample: every decode row token,
    then each chunk's last token."""
    device = chunks.sample_rows.device
    return torch.cat([arange(num_row_tokens, device), chunks.sample_rows + num_row_tokens])


def sample_chunks(logits: torch.Tensor, chunks) -> torch.Tensor:
    """Each chunk's next token from its last token's logits (a chunk that does not end its
    prefill samples one nobody reads, as in an extend step)."""
    rows = arange(logits.shape[0], logits.device)
    return sample(logits, chunks.sampling_info, rows, chunks.positions[chunks.sample_rows] + 1).tokens


def join_decode_result(decoded: StepResult, chunk_tokens: torch.Tensor) -> StepResult:
    """The decode rows' [bs] result (tokens, and logprobs and top alternatives where a row
    asked), then each chunk's token; the chunks' logprobs rows are zeros (no chunk asks)."""
    k = chunk_tokens.shape[0]
    return StepResult(torch.cat([decoded.token_ids, chunk_tokens]), _padded(decoded.logprobs, k), None,
                      _padded(decoded.top_ids, k), _padded(decoded.top_logprobs, k))


def join_verify_result(verify: StepResult, chunk_tokens: torch.Tensor) -> StepResult:
    """The verify rows' [bs, D] result, then each chunk's token in column 0 (one token)."""
    k = chunk_tokens.shape[0]
    padded = chunk_tokens.new_zeros((k, verify.token_ids.shape[1]))
    padded[:, 0] = chunk_tokens
    ones = torch.ones_like(chunk_tokens, dtype=verify.accept_lens.dtype)
    return StepResult(torch.cat([verify.token_ids, padded]), _padded(verify.logprobs, k),
                      torch.cat([verify.accept_lens, ones]), _padded(verify.top_ids, k),
                      _padded(verify.top_logprobs, k))


def _padded(rows: Optional[torch.Tensor], k: int) -> Optional[torch.Tensor]:
    """`rows` with k rows of zeros after them (None stays None)."""
    return None if rows is None else torch.cat([rows, rows.new_zeros((k, *rows.shape[1:]))])
