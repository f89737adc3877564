"""N-gram (prompt lookup) drafting: drafts copied from the request's own prompt and output.

The longest suffix of a request's known tokens (at most `max_n`, at least `min_n` tokens) that
occurred earlier in them is looked up, and the tokens that followed its latest earlier
occurrence are the drafts (vLLM's prompt lookup, SGLang's and TensorRT-LLM's n-gram drafting).
No draft model: agentic, code-edit, RAG and summarisation traffic repeats its context, and the
verifier (spec/verifier.py) keeps the output exactly the target's whatever is copied.

Everything runs on the device, inside the step (and its CUDA graphs), so it adds no host sync:
the drafter keeps every request's tokens in a table by (request row, position), written by the
prefill (the whole sequence once its prefill ends) and by each verify (the emitted tokens),
and matches with tensor ops over the batch.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from specserve.engine.aranges import arange
from specserve.engine.config import SpecConfig
from specserve.engine.forward_batch import KVRows
from specserve.engine.grammar.channel import DeviceChannel
from specserve.engine.runtime.step import ExtendStep
from specserve.engine.runtime.worker import ForwardInputs, TargetModel
from specserve.engine.spec.tree import DraftNodes, TreeShape
from specserve.engine.spec.verifier import Snapshot, SpecDecodeInputs, Verified


class Suffix(NamedTuple):
    """The last `max_n` known tokens of each request, looked up by the matchers."""

    tokens: torch.Tensor     # [bs, max_n]: the token k before the last known one (k = 0: the last)
    known: torch.Tensor      # [bs, max_n]: whether that token exists (k <= last)


class Match(NamedTuple):
    """Each request's best match: how many suffix tokens it covers (0: no match of min_n) and
    the index of the position it ends at."""

    length: torch.Tensor     # [bs]
    end: torch.Tensor        # [bs]


def suffix_of(tokens: torch.Tensor, last: torch.Tensor, max_n: int) -> Suffix:
    """The suffix of sequences `tokens` [bs, W] whose last known token is at `last` [bs]."""
    k = arange(max_n, tokens.device)
    return Suffix(tokens.gather(1, (last[:, None] - k).clamp(min=0)), k <= last[:, None])


def longest_latest(same: torch.Tensor, recency: torch.Tensor, valid: torch.Tensor, min_n: int) -> Match:
    """The longest match, then the most recent among the longest. `same` [bs, E, max_n]: whether
    the token k before candidate end e equals the suffix's token k; a match's length is the run
    of them from k = 0. `recency` [., E] (values in [0, E)): larger is more recent; `valid`
    [., E]: the ends that may match at all."""
    E = same.shape[1]
    run = same.to(torch.int32).cumprod(dim=2).sum(dim=2)                # [bs, E]
    run = torch.where(valid, run, 0)
    score = torch.where(run >= min_n, run * E + recency, -1)
    best, end = score.max(dim=1)
    return Match(torch.where(best >= 0, best // E, 0), end)


def own_match(tokens: torch.Tensor, last: torch.Tensor, suffix: Suffix, min_n: int) -> Match:
    """The best match of `suffix` ending at an earlier position j < last of its own sequence."""
    W = tokens.shape[1]
    k = arange(suffix.tokens.shape[1], tokens.device)
    ends = arange(W, tokens.device)                                     # a match's end j
    back = ends[:, None] - k                                            # [W, max_n]: j - k
    window = tokens[:, back.clamp(min=0)]                               # [bs, W, max_n]: token at j - k
    # Token j - k matches suffix token k while both exist; a match may not reach the suffix
    # itself (j < last).
    same = (window == suffix.tokens[:, None, :]) & (back >= 0) & suffix.known[:, None, :]
    return longest_latest(same, ends[None], ends < last[:, None], min_n)


def copy_own(tokens: torch.Tensor, last: torch.Tensor, match: Match, num_drafts: int) -> torch.Tensor:
    """Drafts [bs, num_drafts] copied from after the match's end j, up to the last known token
    and then that stretch again: a match ending d tokens before the end says the sequence
    continues as it did after j, d tokens ahead, so the copy's continuation is the copy itself
    (a periodic run drafts its period). Without a match the last token is repeated."""
    j = torch.where(match.length > 0, match.end, last - 1)
    period = last - j                                                   # d >= 1
    t = arange(num_drafts, tokens.device)
    return tokens.gather(1, j[:, None] + 1 + t % period[:, None])


def propose(tokens: torch.Tensor, lengths: torch.Tensor, num_drafts: int, min_n: int, max_n: int) -> torch.Tensor:
    """Drafts [bs, num_drafts] for sequences `tokens` [bs, W] of which the first `lengths` [bs]
    (>= 2) are known: the longest suffix of n in [min_n, max_n] tokens that also ends at an
    earlier position j (the latest such j among the longest), then the tokens after j
    (`copy_own`)."""
    last = lengths - 1                                                  # the last known token
    match = own_match(tokens, last, suffix_of(tokens, last, max_n), min_n)
    return copy_own(tokens, last, match, num_drafts)


class NgramPrefill(NamedTuple):
    """Each request whose prefill ends: its whole sequence, by (row, position)."""

    rows: torch.Tensor       # [N]
    positions: torch.Tensor  # [N]
    tokens: torch.Tensor     # [N]


class NgramDrafter:
    """Prompt-lookup drafter (spec/drafter.py Drafter): a chain of num_draft_tokens - 1 copied
    tokens per request."""

    feature_layers = None
    refreshes_state = False  # a copy costs nothing at depth 0

    def __init__(self, target: TargetModel, spec: SpecConfig):
        self.target = target
        self.shape = TreeShape(1, spec.num_steps, spec.num_draft_tokens)
        # Copied drafts are not masked: the grammar process only masks the verify tree.
        self.grammar_shape = TreeShape(1, 1, spec.num_draft_tokens)
        self.min_n, self.max_n = spec.ngram_min, spec.ngram_max
        table = target.req_to_token.table
        # Token at (row, position) of each request (row 0: padding rows).
        self.tokens = torch.zeros_like(table)

    def at_shape(self, depth: int, width: int) -> "NgramDrafter":
        """This drafter drafting `depth` tokens (adaptive speculation; the token table is
        shared). Copied drafts are chains: width 1 only."""
        if width != 1:
            raise ValueError(f"width: {type(self).__name__} drafts chains (width 1), got {width!r}")
        drafter = copy.copy(self)
        drafter.shape = TreeShape(1, depth, depth + 1)
        drafter.grammar_shape = TreeShape(1, 1, depth + 1)
        return drafter

    @property
    def _channel(self) -> DeviceChannel:
        return self.target.grammar.device

    def prefill_inputs(self, step: ExtendStep) -> NgramPrefill:
        rows, positions, tokens = [], [], []
        for row, fill, (_, end), samples in zip(step.rows, step.fill_ids, step.chunks, step.samples):
            if samples:  # chunks before it: the whole sequence is written once, with its cached prefix
                rows += [row] * end
                positions += range(end)
                tokens += fill[:end]
        to = self.target.to_device
        return NgramPrefill(to(rows), to(positions), to(tokens))

    def after_prefill(self, inputs: NgramPrefill, target: ForwardInputs, tokens: torch.Tensor,
                      feats: torch.Tensor, kv: KVRows) -> None:
        self.tokens[inputs.rows, inputs.positions] = inputs.tokens
        # The sampled token (rows of chunks that sample nothing write padding row 0).
        self.tokens[target.stash_rows, target.prefix_lens + target.extend_lens] = tokens

    def captured_extend_part(self, width: int):
        return None  # a captured extend has no host view of a cached prefix's tokens

    def captured_mixed_part(self, width: int):
        return None  # no draft forward: after_verify and after_prefill write the token table

    def draft(self, s: SpecDecodeInputs, snap: Snapshot) -> DraftNodes:
        """The bonus token at S is the last known one (written by the last verify or prefill)."""
        if s.constrained:  # the grammar process's first phase, the committed masks: not needed here
            self._channel.signal()
            self._channel.masks(s.rows.shape[0])
        keep = self.shape.num_draft_tokens - 1
        drafts = self._propose(self.tokens[s.rows, :s.width], s.S + 1, keep)
        return DraftNodes(drafts, arange(keep, drafts.device).expand_as(drafts))

    def _propose(self, tokens: torch.Tensor, lengths: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """The drafts of the batch's sequences (spec/suffix.py looks further)."""
        return propose(tokens, lengths, num_drafts, self.min_n, self.max_n)

    def after_verify(self, v: Verified) -> None:
        """The emitted tokens at S + 1 ...: the accepted run's (and past it, tokens the next
        iteration does not read: it reads up to its bonus token)."""
        self.tokens[v.inputs.rows[:, None], v.chain_pos + 1] = v.accept.tokens
