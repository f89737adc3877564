"""Host-side request state, and the decisions the scheduler launches."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch

from specserve.engine.config import SamplingParams
from specserve.engine.forward_batch import ForwardMode
from specserve.engine.grammar.process import GrammarState
from specserve.engine.kvcache.radix_cache import PrefixMatch
from specserve.engine.outputs import FinishError, TopLogprobs
from specserve.engine.runtime.step import Launched
from specserve.engine.scheduler.step_cost import StepCost


class ReqStatus(enum.Enum):
    WAITING = enum.auto()   # queued, or retracted back to the queue (no KV)
    RUNNING = enum.auto()   # holds a row and KV (prefilling in chunks, or decoding)
    FINISHED = enum.auto()


@dataclass(eq=False)
class PromptScores:
    """Prompt scoring (sampling.prompt_logprobs) of one request, shared by its sequences: the
    log-probabilities of prompt tokens 1.. (and their alternatives), scored once by whichever
    sequence prefills them."""

    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    scored_to: int = 1    # schedule side: the next prompt token a chunk will score


@dataclass(eq=False)
class SharedPrefix:
    """The KV of the first `length` prompt tokens of an n > 1 request, prefilled once and owned
    jointly by its sequences (reference-counted); the last owner to let go frees the slots.

    One sequence prefills it (the `creator`, admitted first); once its prefill has been
    scheduled past `length`, the slots are captured and every later sequence maps them into its
    own row and prefills only the last prompt token (to sample its own first token). A
    sequence retracted and admitted again takes the prefix again while it lives; once freed, the
    next sequence admitted creates it anew."""

    length: int
    slots: Optional[torch.Tensor] = None   # [length] KV slots, once captured
    # With the prefix cache the tree owns the prefix instead: the creator caches it once its
    # prefill is scheduled past `length`, and the other sequences find it there when admitted.
    cached: bool = False
    owners: int = 0
    creator: Optional["Req"] = None

    @property
    def live(self) -> bool:
        return self.slots is not None

    def blocks(self, req: "Req") -> bool:
        """Whether `req` must wait to be admitted: another sequence is prefilling the prefix."""
        return self.creator is not None and self.creator is not req


@dataclass(eq=False)
class Req:
    """One sequence of a request (a request with n > 1 has n, sharing the prompt's KV). Its KV
    lengths change only through the methods below."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset
    index: int = 0               # the sequence's index within its request (n > 1)
    shared: Optional[SharedPrefix] = None  # the prompt KV shared with the request's other sequences
    owns_share: bool = False     # holds a reference to shared (its row maps shared.slots)
    output_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[TopLogprobs]] = None  # per output token, when asked for
    prompt_scores: PromptScores = field(default_factory=lambda: PromptScores())  # shared by the sequences
    prompt_logprobs_emitted: bool = False
    status: ReqStatus = ReqStatus.WAITING
    row: int = 0                 # request-table row; 0 (the padding row) when it holds none
    fill_ids: list[int] = field(default_factory=list)  # tokens to prefill: prompt + outputs so far
    num_prefilled: int = 0       # tokens of fill_ids whose KV is scheduled
    kv_committed_len: int = 0    # tokens whose KV is final (host view, lags in overlap)
    kv_allocated_len: int = 0    # slots reserved in the row
    num_inflight_tokens: int = 0  # sampling steps launched whose results are not processed yet
    finish_reason: Optional[str] = None
    error: Optional[FinishError] = None  # finish_reason "error": why the engine failed it
    matched_stop: Optional[int] = None
    num_emitted: int = 0         # output tokens already handed out in StepOutputs
    num_verify_steps: int = 0
    num_accepted_drafts: int = 0
    admit_order: int = 0
    prefix: Optional[PrefixMatch] = None  # the cached prefix its row starts with, while it holds one
    cached_tokens: int = 0       # prompt tokens served from the prefix cache at its first admission
    num_bypassed: int = 0        # later arrivals admitted before it (the prefix-match order's aging)
    prefix_keys: Optional[tuple[int, list[int]]] = None  # (seq_len, cache keys) memo for admission
    serial: int = 0              # set by the scheduler: unique for the engine's lifetime, unlike a rid
    grammar: Optional[GrammarState] = None  # structured output: set by the scheduler when it is added
    # time.perf_counter() stamps for the server's TTFT breakdown (0.0: not yet): added to the
    # scheduler, its first prefill chunk launched, its first token on the host.
    received_at: float = 0.0
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    stamps_sent: bool = False    # handed out on its first output with tokens

    @property
    def waits_for_grammar(self) -> bool:
        """Its grammar is still compiling: it is not admitted yet (others are)."""
        return self.grammar is not None and not self.grammar.ready

    @property
    def key(self) -> tuple[str, int]:
        return self.rid, self.index

    @property
    def is_prefilling(self) -> bool:
        return self.status is ReqStatus.RUNNING and self.num_prefilled < len(self.fill_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def cached_len(self) -> int:
        """Leading positions of its row that the prefix cache owns (and this request pins)."""
        return self.prefix.length if self.prefix is not None else 0

    def admit(self, row: int, order: int, prefix: Optional[PrefixMatch] = None, prefilled: int = 0) -> None:
        """Take a row; prefill prompt + outputs so far (after a retraction, outputs stay exact),
        past the KV the row maps already: a cached prefix (pinned in the prefix cache), or
        without the cache the `prefilled` tokens of a shared prefix (n > 1)."""
        if self.admit_order == 0:
            self.cached_tokens = min(prefix.length if prefix is not None else 0, len(self.prompt_ids))
        self.status = ReqStatus.RUNNING
        self.row, self.admit_order, self.prefix = row, order, prefix
        self.fill_ids = self.prompt_ids + self.output_ids
        self.num_prefilled = self.kv_committed_len = self.kv_allocated_len = \
            prefix.length if prefix is not None else prefilled

    def take_chunk(self, n: int) -> tuple[int, int]:
        """The next n fill tokens; their KV slots are allocated, and final once written."""
        start = self.num_prefilled
        self.num_prefilled = self.kv_committed_len = self.kv_allocated_len = start + n
        return start, start + n

    def take_prompt_span(self, start: int, end: int) -> Optional[tuple[int, int]]:
        """The prompt tokens [a, b) that the chunk [start, end) scores, if it asks for any: the
        row at position i - 1 gives token i's log-probability. Each is scored once, even when
        a retraction prefills the prompt again or another sequence of the request prefills it."""
        if self.sampling.prompt_logprobs is None:
            return None
        a, b = max(self.prompt_scores.scored_to, start + 1), min(end + 1, len(self.prompt_ids))
        if a >= b:
            return None
        self.prompt_scores.scored_to = b
        return a, b

    def reserve(self, n: int) -> None:
        self.kv_allocated_len += n

    def commit(self, n: int) -> None:
        self.kv_committed_len += n

    def release(self) -> None:
        """The row and slots are gone (the caller freed them or gave them to the cache)."""
        self.row, self.prefix = 0, None
        self.num_prefilled = self.kv_committed_len = self.kv_allocated_len = 0


class MixedPlan(NamedTuple):
    """What a decode-side step where prompts could ride was planned with (the step log shows
    it, scheduler/step_log.py): the prompt budget and the term that set it
    (mixed_batch.PromptBudget's, or "chunk": chunked_prefill_size), the prompt tokens waiting
    (counted up to what the budget can use) and the step-cost model it was priced by (None:
    no model)."""

    budget: int
    bound: str
    backlog: int
    cost: Optional[StepCost]


class Decision(NamedTuple):
    """What the next launch covers. EXTEND: per request, the [start, end) chunk of its fill
    ids, whether it samples a token and the prompt tokens it scores (Req.take_prompt_span);
    DECODE: one (speculative) step per request; MIXED: one decode step of the first
    `num_decode` requests and the chunks of the others (chunks, samples and prompt_spans are
    theirs), in one forward. `plan`: what a decode-side step where prompts could ride was
    planned with (None for the other steps)."""

    mode: ForwardMode
    reqs: list[Req]
    chunks: Sequence[tuple[int, int]] = ()
    samples: Sequence[bool] = ()
    prompt_spans: Sequence[Optional[tuple[int, int]]] = ()
    num_decode: int = 0
    plan: Optional[MixedPlan] = None

    @property
    def priced(self) -> bool:
        """A step whose time refines the mixed steps' cost model (policy.py `step_cost`: the
        mixed steps, and the decode steps scheduled where one could mix): one planned by it."""
        return self.plan is not None and self.plan.cost is not None

    @property
    def decode_reqs(self) -> list[Req]:
        return self.reqs[:self.num_decode] if self.mode is ForwardMode.MIXED else \
            (self.reqs if self.mode is ForwardMode.DECODE else [])

    @property
    def extend_reqs(self) -> list[Req]:
        return self.reqs[self.num_decode:] if self.mode is ForwardMode.MIXED else \
            (self.reqs if self.mode is ForwardMode.EXTEND else [])


class InflightBatch(NamedTuple):
    """A launched decision, kept (with the device tensors it reads) until it is processed."""

    decision: Decision
    launched: Launched
    launched_at: float = 0.0     # Scheduler.clock() (time.perf_counter()) when it was launched
    num_others: int = 0          # requests holding a row that this step does not advance
