"""Suffix drafting across requests: n-gram drafting (spec/ngram.py) that also looks the
request's suffix up in a corpus of recent requests' outputs.

Agentic, code-edit and RAG traffic repeats what earlier requests answered (the same tool
output, the same file rewritten); a request's own tokens do not hold that, the outputs of
requests that finished before it do. The corpus is a fixed-size ring buffer of token ids on
the device (`SpecConfig.suffix_corpus_tokens`): when a sequence finishes, the scheduler hands
its output, after the last `ngram_max - 1` prompt tokens (the context its first output
token's match needs), to `SuffixDrafter.remember`, which appends it and a sentinel (an id no
token has, so no match runs across two records or into unwritten space) with a non-blocking
copy ordered on the forward stream after the forwards already launched. Prompts are not
stored: a request's own lookup covers its prompt, and whole prompts would crowd the outputs out.

Each step the longest suffix (ngram_max..ngram_min tokens) is matched in both the request's
own tokens (as n-gram drafting does) and the corpus, with the same tensor ops, inside the
step (and its CUDA graph: the ring's shape is static), so no host sync is added. The longer
match wins; on a tie the request's own; within the corpus the most recent position. A corpus
match is only taken where a continuation follows it (not the sentinel); the drafts are the
tokens after it, the last token standing in from a record's end on.

Arctic Inference's suffix decoding (vLLM, SGLang) keeps suffix trees on the host, with counts,
and drafts the most frequent continuation with a score-based length. Here the lookup is a
longest match over the device-resident ring (no frequency counts, the latest occurrence
wins, the draft length fixed or adaptive speculation's): a host tree would need every step's
tokens on the host before the next step's drafts, a sync per step that the overlap loop
exists to avoid. The verifier keeps the output exactly the target's whatever the corpus holds.
"""
from __future__ import annotations

import torch

from specserve.engine.aranges import arange
from specserve.engine.config import SpecConfig
from specserve.engine.runtime.device import DeviceContext
from specserve.engine.runtime.worker import TargetModel
from specserve.engine.spec.ngram import Match, NgramDrafter, Suffix, copy_own, longest_latest, own_match, suffix_of

SENTINEL = -1  # ends each record and fills unwritten space: token ids are >= 0


class SuffixCorpus:
    """The ring buffer of remembered outputs on the device: `tokens` [C], `head` (where the
    next record goes: the oldest token), and what each step's lookup reads, kept current by
    every append instead of derived every step: the tokens ending at each position, whether a
    token follows it, and its age rank. The host keeps its own `head` to place records
    without reading the device."""

    def __init__(self, num_tokens: int, max_n: int, ctx: DeviceContext):
        self.ctx = ctx
        device = ctx.device
        self.tokens = torch.full((num_tokens,), SENTINEL, dtype=torch.int64, device=device)
        self.head = torch.zeros((), dtype=torch.int64, device=device)
        self._head = 0
        ends = torch.arange(num_tokens, device=device)
        self._window_index = (ends[:, None] - torch.arange(max_n, device=device)) % num_tokens
        self._next_index = (ends + 1) % num_tokens
        self.window = self.tokens[self._window_index]     # [C, max_n]: the token k before each end
        self.followed = torch.zeros(num_tokens, dtype=torch.bool, device=device)  # by a token
        self.recency = ends.clone()                       # (end - head) mod C: 0 the oldest

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def append(self, record: list[int]) -> None:
        """Store `record` (its last size - 1 tokens) and a sentinel after the last record,
        overwriting the oldest. The copy runs on the forward stream after every forward
        already launched (which may still read the ring) and before the next."""
        record = record[-(self.size - 1):] + [SENTINEL]
        start, n = self._head, len(record)
        self._head = (start + n) % self.size
        host = torch.tensor(record + [self._head], dtype=torch.int64, pin_memory=self.tokens.is_cuda)
        first = min(n, self.size - start)  # up to the ring's end, the rest from its start

        def write():
            self.tokens[start:start + first].copy_(host[:first], non_blocking=True)
            self.tokens[:n - first].copy_(host[first:n], non_blocking=True)
            self.head.copy_(host[n], non_blocking=True)
            torch.index_select(self.tokens, 0, self._window_index.view(-1), out=self.window.view(-1))
            torch.ne(self.tokens[self._next_index], SENTINEL, out=self.followed)
            torch.remainder(arange(self.size, self.tokens.device) - self.head, self.size, out=self.recency)

        self.ctx.launch(write)

    def match(self, suffix: Suffix, min_n: int) -> Match:
        """The longest match of `suffix` ending anywhere in the ring with a token after it,
        the most recent among the longest (a match's tokens may wrap around the ring's end)."""
        same = (self.window[None] == suffix.tokens[:, None, :]) & suffix.known[:, None, :]
        return longest_latest(same, self.recency[None], self.followed[None], min_n)

    def copy(self, match: Match, last_token: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """Drafts [bs, num_drafts]: the tokens after each match's end; from the record's end
        (its sentinel) on, `last_token` [bs]."""
        t = arange(num_drafts, self.tokens.device)
        drafts = self.tokens[(match.end[:, None] + 1 + t) % self.size]
        ended = (drafts == SENTINEL).cumsum(dim=1) > 0
        return torch.where(ended, last_token[:, None], drafts)


def propose_across(tokens: torch.Tensor, lengths: torch.Tensor, corpus: SuffixCorpus, num_drafts: int,
                   min_n: int, max_n: int) -> torch.Tensor:
    """Drafts [bs, num_drafts] for sequences `tokens` [bs, W] of which the first `lengths` [bs]
    (>= 2) are known: copied after the longer of the best match in its own tokens
    (ngram.propose's) and the best in `corpus`; a tie goes to its own."""
    last = lengths - 1
    suffix = suffix_of(tokens, last, max_n)
    own = own_match(tokens, last, suffix, min_n)
    found = corpus.match(suffix, min_n)
    from_corpus = corpus.copy(found, suffix.tokens[:, 0], num_drafts)
    return torch.where((found.length > own.length)[:, None], from_corpus, copy_own(tokens, last, own, num_drafts))


class SuffixDrafter(NgramDrafter):
    """N-gram drafting (its token table, prefill and verify bookkeeping) plus the corpus of
    finished sequences' outputs, shared by every request (and every `at_shape` copy)."""

    def __init__(self, target: TargetModel, spec: SpecConfig):
        super().__init__(target, spec)
        self.corpus = SuffixCorpus(spec.suffix_corpus_tokens, spec.ngram_max, target.ctx)

    def remember(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Schedule side: a sequence finished with these tokens."""
        if output_ids:
            self.corpus.append(prompt_ids[max(0, len(prompt_ids) - (self.max_n - 1)):] + output_ids)

    def _propose(self, tokens: torch.Tensor, lengths: torch.Tensor, num_drafts: int) -> torch.Tensor:
        return propose_across(tokens, lengths, self.corpus, num_drafts, self.min_n, self.max_n)
