"""CUDA graphs of the mixed step's target forward (runtime/mixed_step.py): the decode or verify
rows and the prompt chunks as one captured ragged extend.

Eagerly a mixed step is the target's hundreds of host launches: at 64 streams (8B chain, H100)
the decode-side step's mean rose from 13.0 to 20.5 ms with mixed steps on. Two ways to graph a
forward whose layout changes with every arrival:

* piecewise: every layer's non-attention work captured per token count, the attention eager
  between the pieces (vLLM, SGLang). Every model would have to be cut into pieces at its
  attention calls, and a forward still launches each layer's attention and replays a graph per
  layer: some hundred launches.
* the mixed batch as a captured extend (this module). `captured_extend.py` already replays
  ragged extends whose every length lives on the device: token buckets T, a chunk bound M, R
  entries, padding entries. A plain decode row is one such entry (1 token over its prefix), a
  chain verify row another (its D causal nodes over its prefix), a chunk a third; so the mixed
  forward is one replay, keyed by (T, M, R) and not by (decode batch x prompt tokens).

The second is taken. Around the replay the workers do what they do around the eager forward,
reading its outputs: the logits of the rows that sample (every decode or verify token and each
chunk's last: a device index, as eagerly) and the sampling with each part's own SamplingInfo
(so sampled, seeded and filtered rows ride the graphs too); with chain speculation the
drafter's draft before it and the verifier's accept after it replay graphs of their own per
decode-batch bucket (spec/spec_worker.py, the mixed wrap), and a draft model's draft-extends
of both parts are this module's graphs' second part: one draft forward over the same layout
and features (`MixedGraphInputs.draft_ids`, the stash entries; `load_mixed_draft`). Tree
verify rows carry a custom mask and run eagerly, as does any step no bucket holds.

Buckets: T in TOKEN_BUCKETS (the extends', and steps of a quarter between them from 256 on);
M as the extends' (64 up to T = 256: Triton's split extend over the prefix, which a verify row
wants; 256 above, the arrivals' prompts; and T) capped at the rows' width; R, the real entries
(decode rows and chunks, at most the engine's rows), in rungs (16, 64, 256, the rows), so
that a small batch does not run the attention grid of the largest. Padding is
captured_extend's: token 0 at position 0 into slot 0, in entries of their own (pool row 0, no
prefix) right after the real ones, then empty entries. The scheduler rounds the prompt budget
up to the next T (scheduler/mixed_batch.py `prompt_budget`): padding a bucket costs what
prompt tokens in its place would.

Unlike the captured extend, every graph writes its outputs (the last hidden states and the
EAGLE-3 features, [T, ...]) into one buffer all buckets share (`SharedOutputs`), so the
buckets keep no outputs of their own in the graphs' pool; one step replays at a time, and it
consumes them before the next. The graphs read the request table themselves (pool rows per
entry), so a graphed step records `read_done` after them, as the decode graphs do.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from specserve.engine.runtime.captured_extend import SPLIT_CHUNK, ExtendBucket, entry_lens
from specserve.engine.runtime.mixed_step import DecodeRows

# T: the extends' buckets and steps of a quarter between them from 256 on. The budget holds a
# step within DRAIN_TIME_RATIO of its decode rows' in whole buckets (scheduler/mixed_batch.py),
# so a coarse ladder drains less: on an H100 at 256 chain streams (150-200 rows of 4, 600-800
# tokens) the 1024 bucket held ~300 prompt tokens a step, fewer than arrived (TTFT p50 1.1 s),
# where 1280 holds ~600; and 64 rows (256 tokens) with any prompt replayed 512 tokens, 1.5x
# their step, where 384 holds a prompt of 128.
TOKEN_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)
ENTRY_RUNGS = (16, 64, 256)  # R below the engine's rows (the largest rung)


def mixed_buckets(max_entries: int, width: int) -> list[ExtendBucket]:
    """The captured buckets, smallest first: per T, M of 64 (T <= 256) or 256 and of T, capped
    at the rows' width; R in the rungs up to `max_entries` (the engine's rows: every decode row
    and chunk holds one), never more than T."""
    buckets = set()
    for tokens in TOKEN_BUCKETS:
        for max_chunk in (SPLIT_CHUNK if tokens <= 256 else 256, tokens):
            for entries in (*ENTRY_RUNGS, max_entries):
                buckets.add(ExtendBucket(tokens, min(max_chunk, width), min(entries, max_entries, tokens)))
    return sorted(buckets)


def mixed_bucket(row_width: int, num_rows: int, chunk_lens: Sequence[int], custom_mask: bool,
                 buckets: Sequence[ExtendBucket]) -> Optional[ExtendBucket]:
    """The smallest bucket of `num_rows` decode rows of `row_width` tokens and the chunks; None
    (eager): a tree verify's mask, or more tokens, a longer chunk or more entries than any holds."""
    if custom_mask:
        return None
    total = num_rows * row_width + sum(chunk_lens)
    longest = max(row_width, *chunk_lens)
    entries = num_rows + len(chunk_lens)
    return next((b for b in buckets if b.tokens >= total and b.max_chunk >= longest
                 and b.requests >= entries), None)


class MixedGraphInputs(NamedTuple):
    """The static inputs of a captured mixed forward: the rows' tokens, then the chunks', then
    padding; per entry its pool row, prefix and length (padding entries: theirs; empty: 0).
    With a draft model, its draft-extend over the same layout (`load_mixed_draft`)."""

    ids: torch.Tensor          # [T]
    positions: torch.Tensor    # [T]
    loc: torch.Tensor          # [T] KV slots (padding: slot 0)
    rows: torch.Tensor         # [E] request-table row per entry
    prefix_lens: torch.Tensor  # [E]
    extend_lens: torch.Tensor  # [E]
    draft_ids: torch.Tensor    # [T] the draft-extend's ids: each token's successor (padding: 0)
    stash_rows: torch.Tensor   # [R] the row each real entry stashes the next draft state of (else 0)
    stash_index: torch.Tensor  # [R] the token whose draft output that is (else T - 1)
    max_chunk: int             # M: the host bound the attention's grid is sized by


class MixedForwardOut(NamedTuple):
    """What a captured mixed forward hands the draft-extend after it: the static inputs, and
    the views of the shared outputs it wrote (the bucket's T tokens)."""

    inputs: MixedGraphInputs
    hidden: torch.Tensor
    aux: Optional[torch.Tensor]


def make_mixed_inputs(bucket: ExtendBucket, device: torch.device) -> MixedGraphInputs:
    """Static inputs of one bucket, holding a valid forward of padding alone."""
    T, E, R = bucket.tokens, bucket.entries, bucket.requests
    zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
    lens = entry_lens(bucket, [], T).to(device)
    return MixedGraphInputs(zeros(T), zeros(T), zeros(T), zeros(E), zeros(E), lens, zeros(T), zeros(R),
                            torch.full((R,), T - 1, dtype=torch.int64, device=device), bucket.max_chunk)


def load_mixed_inputs(static: MixedGraphInputs, bucket: ExtendBucket, rows: DecodeRows,
                      table_rows: torch.Tensor, chunks) -> int:
    """Copy one step's decode rows (`table_rows`: their request-table rows) and chunks (a
    worker's extend ForwardInputs) into a bucket's static inputs on the forward stream, padding
    after them; returns the real tokens' count."""
    n = rows.input_ids.shape[0] + chunks.input_ids.shape[0]
    e = table_rows.shape[0] + chunks.rows.shape[0]
    for out, of_rows, of_chunks, count in (
            (static.ids, rows.input_ids, chunks.input_ids, n),
            (static.positions, rows.positions, chunks.positions, n),
            (static.loc, rows.out_cache_loc, chunks.out_cache_loc, n),
            (static.rows, table_rows, chunks.rows, e),
            (static.prefix_lens, rows.prefix_lens, chunks.prefix_lens, e)):
        torch.cat([of_rows, of_chunks], out=out[:count])
        out[count:].zero_()
    lens = [rows.width] * table_rows.shape[0] + list(chunks.extend_lens_cpu)
    static.extend_lens.copy_(entry_lens(bucket, lens, bucket.tokens - n), non_blocking=True)
    return n


def load_mixed_draft(static: MixedGraphInputs, ids: Sequence[torch.Tensor], stash_rows: torch.Tensor,
                     stash_index: torch.Tensor) -> None:
    """Copy a step's draft-extend inputs into a bucket's static inputs (on the forward stream):
    `ids` in the forward's order (the verify rows' emitted tokens, the chunks' shifted ids),
    padding after them; per real entry the row its draft state goes to and the token it is
    read from; the rest stash into row 0 from the last token."""
    n, k = sum(t.shape[0] for t in ids), stash_rows.shape[0]
    torch.cat(list(ids), out=static.draft_ids[:n])
    static.draft_ids[n:].zero_()
    static.stash_rows[:k].copy_(stash_rows)
    static.stash_rows[k:].zero_()
    static.stash_index[:k].copy_(stash_index)
    static.stash_index[k:].fill_(static.ids.shape[0] - 1)


class SharedOutputs:
    """The one output buffer of every mixed graph: the last hidden states and the auxiliary
    features of up to `max_tokens` tokens. Allocated at the first write (the largest bucket's
    warm-up, before any capture), in the forward's own shapes and dtypes, zeroed: the
    speculative wrap's graphs (spec/spec_worker.py) read the first rows of a decode-batch
    bucket, whose padded rows may lie past anything a forward wrote."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.buffers: Optional[list[torch.Tensor]] = None

    def write(self, hidden: torch.Tensor, aux: Optional[torch.Tensor]):
        """Copy a forward's (hidden, aux) in; returns views of the buffer of the same shapes."""
        values = [hidden] if aux is None else [hidden, aux]
        if self.buffers is None:
            self.buffers = [v.new_zeros((self.max_tokens, *v.shape[1:])) for v in values]
        views = [buf[:v.shape[0]] for buf, v in zip(self.buffers, values)]
        for view, v in zip(views, values):
            view.copy_(v)
        return views[0], (views[1] if aux is not None else None)

    def read(self, n: int):
        """(hidden, aux or None) of the first `n` tokens the last replay wrote (views)."""
        views = [buf[:n] for buf in self.buffers]
        return views[0], (views[1] if len(views) > 1 else None)


def mixed_outputs(decode_tokens: int) -> SharedOutputs:
    """The buffer a worker's mixed graphs share: the largest bucket's tokens, and at least
    `decode_tokens` (every row's decode or verify tokens, which the speculative wrap's graphs
    read per decode-batch bucket)."""
    return SharedOutputs(max(TOKEN_BUCKETS[-1], decode_tokens))


def replay_mixed(graphs, bucket: ExtendBucket, rows: DecodeRows, table_rows: torch.Tensor, chunks):
    """Load one step into `bucket`'s inputs and replay its graph (`graphs`: the worker's
    GraphedStep of mixed forwards); (hidden, aux) of the step's real tokens, views of the
    shared outputs that the next replay overwrites."""
    captured = graphs.captured[bucket]
    n = load_mixed_inputs(captured.inputs, bucket, rows, table_rows, chunks)
    out = graphs.replay(captured, 0)
    return out.hidden[:n], None if out.aux is None else out.aux[:n]


def mixed_graph_tokens(worker) -> tuple[int, ...]:
    """The token counts T of a worker's mixed graphs (the scheduler's prompt budget rounds up to
    them); () without."""
    graphs = worker.mixed_graphs
    return () if graphs is None else tuple(sorted({b.tokens for b in graphs.buckets}))
