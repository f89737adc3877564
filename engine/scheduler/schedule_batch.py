"""Host-side request state and the batches the scheduler builds from it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from specserve.engine.config import SamplingParams
from specserve.engine.layers.sampler import SamplingInfo
from specserve.engine.runtime.forward_batch import ForwardMode


class ReqStatus(enum.Enum):
    WAITING = enum.auto()   # queued, or retracted back to the queue (no KV)
    RUNNING = enum.auto()   # holds a row and KV (prefilling in chunks, or decoding)
    FINISHED = enum.auto()


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset
    output_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    status: ReqStatus = ReqStatus.WAITING
    row: int = 0                 # req_pool_idx; 0 (the padding row) when it holds none
    fill_ids: list[int] = field(default_factory=list)  # tokens to prefill: prompt + outputs so far
    num_prefilled: int = 0       # tokens of fill_ids whose KV is scheduled
    kv_committed_len: int = 0    # tokens whose KV is final (host view, lags in overlap)
    kv_allocated_len: int = 0    # slots reserved in the row
    num_inflight_tokens: int = 0  # tokens scheduled on the device but not processed yet
    finish_reason: Optional[str] = None
    matched_stop: Optional[int] = None
    num_emitted: int = 0         # output tokens already handed out in StepOutputs
    num_verify_steps: int = 0
    num_accepted_drafts: int = 0
    admit_order: int = 0
    serial: int = 0              # set by the scheduler when the request is added

    @property
    def is_prefilling(self) -> bool:
        return self.status is ReqStatus.RUNNING and self.num_prefilled < len(self.fill_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class ScheduleBatch:
    """What one launch covers; kept alive until its result is processed."""

    mode: ForwardMode
    reqs: list[Req]
    # EXTEND: per request, the [start, end) chunk of fill_ids and whether it samples a token.
    chunks: list[tuple[int, int]] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    sampling_info: Optional[SamplingInfo] = None
    result: Any = None           # the worker's result (tokens on the host after copy_done)
    keep_alive: list = field(default_factory=list)  # device tensors the forward reads

    @property
    def batch_size(self) -> int:
        return len(self.reqs)


@dataclass
class BatchResult:
    """Forward outputs copied to the host; valid once `copy_done` has fired."""

    copy_done: Any
    token_ids: torch.Tensor                     # [bs] or, speculative, [bs, num_steps + 1]
    logprobs: Optional[torch.Tensor] = None
    accept_lens: Optional[torch.Tensor] = None  # speculative: tokens emitted per request
