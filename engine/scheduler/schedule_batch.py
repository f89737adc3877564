"""Host-side request state, and the decisions the scheduler launches."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from specserve.engine.config import SamplingParams
from specserve.engine.forward_batch import ForwardMode
from specserve.engine.kvcache.radix_cache import PrefixMatch
from specserve.engine.runtime.step import Launched


class ReqStatus(enum.Enum):
    WAITING = enum.auto()   # queued, or retracted back to the queue (no KV)
    RUNNING = enum.auto()   # holds a row and KV (prefilling in chunks, or decoding)
    FINISHED = enum.auto()


@dataclass(eq=False)
class Req:
    """One request. Its KV lengths change only through the methods below."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset
    output_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    status: ReqStatus = ReqStatus.WAITING
    row: int = 0                 # request-table row; 0 (the padding row) when it holds none
    fill_ids: list[int] = field(default_factory=list)  # tokens to prefill: prompt + outputs so far
    num_prefilled: int = 0       # tokens of fill_ids whose KV is scheduled
    kv_committed_len: int = 0    # tokens whose KV is final (host view, lags in overlap)
    kv_allocated_len: int = 0    # slots reserved in the row
    num_inflight_tokens: int = 0  # sampling steps launched whose results are not processed yet
    finish_reason: Optional[str] = None
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

    def admit(self, row: int, order: int, prefix: Optional[PrefixMatch] = None) -> None:
        """Take a row; prefill prompt + outputs so far (after a retraction, outputs stay exact),
        starting after the cached prefix (its KV is final already)."""
        if self.admit_order == 0:
            self.cached_tokens = min(prefix.length if prefix is not None else 0, len(self.prompt_ids))
        self.status = ReqStatus.RUNNING
        self.row, self.admit_order, self.prefix = row, order, prefix
        self.fill_ids = self.prompt_ids + self.output_ids
        self.num_prefilled = self.kv_committed_len = self.kv_allocated_len = self.cached_len

    def take_chunk(self, n: int) -> tuple[int, int]:
        """The next n fill tokens; their KV slots are allocated, and final once written."""
        start = self.num_prefilled
        self.num_prefilled = self.kv_committed_len = self.kv_allocated_len = start + n
        return start, start + n

    def reserve(self, n: int) -> None:
        self.kv_allocated_len += n

    def commit(self, n: int) -> None:
        self.kv_committed_len += n

    def release(self) -> None:
        """The row and slots are gone (the caller freed them or gave them to the cache)."""
        self.row, self.prefix = 0, None
        self.num_prefilled = self.kv_committed_len = self.kv_allocated_len = 0


class Decision(NamedTuple):
    """What the next launch covers. EXTEND: per request, the [start, end) chunk of its fill
    ids and whether it samples a token; DECODE: one (speculative) step per request."""

    mode: ForwardMode
    reqs: list[Req]
    chunks: Sequence[tuple[int, int]] = ()
    samples: Sequence[bool] = ()


class InflightBatch(NamedTuple):
    """A launched decision, kept (with the device tensors it reads) until it is processed."""

    decision: Decision
    launched: Launched
