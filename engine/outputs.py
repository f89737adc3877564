"""What the engine hands back: what it serves, incremental step outputs, finished generations
and its load. The server receives the same types (engine/wire.py converts them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from specserve.engine.config import SpecConfig

# The most likely tokens at one position, most likely first: (token id, log-probability).
TopLogprobs = list[tuple[int, float]]


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves. Models are named by their folder's name, never by a path."""

    model: str
    architecture: str
    vocab_size: int
    max_context_len: int
    dtype: str                   # activations (and 16-bit weights)
    device: str
    eos_token_ids: tuple[int, ...]
    spec: Optional[SpecConfig]   # the speculative configuration, its draft_model a name too
    weight_dtype: str = ""       # the target's linear weights: dtype, or e.g. "fp8 (block 128x128)"
    kv_cache_dtype: str = ""     # what the KV pool stores


class FinishError(NamedTuple):
    """Why a sequence failed (finish_reason "error"): `code` is a gRPC status code name, which
    both fronts turn into their status (INVALID_ARGUMENT: the request cannot be served as sent,
    e.g. a grammar over its compile budget; UNAVAILABLE: a service it needs is down, retry;
    INTERNAL: the engine failed it). The message starts with the field at fault, if one is."""

    code: str
    message: str


@dataclass
class StepOutput:
    """New tokens of one sequence of a request from one scheduler step (a speculative step may
    emit several). A request with n > 1 has n sequences, each finishing on its own.

    `finished` is True on the request's last StepOutput; `finish_reason` is then
    "stop" (EOS or a stop token; `matched_stop` says which), "length", "abort" (the server
    aborted it) or "error" (the engine failed it: `error` says why).
    """

    rid: str
    new_token_ids: list[int]
    index: int = 0                # the sequence's index within its request (n > 1)
    new_logprobs: Optional[list[float]] = None
    new_top_logprobs: Optional[list[TopLogprobs]] = None  # one per new token (top_logprobs)
    # Sent once, on the request's first output (prompt_logprobs): prompt tokens 1.. on.
    prompt_logprobs: Optional[list[float]] = None
    prompt_top_logprobs: Optional[list[TopLogprobs]] = None
    finished: bool = False
    finish_reason: Optional[str] = None
    matched_stop: Optional[int] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_verify_steps: int = 0
    num_accepted_drafts: int = 0
    cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache
    # On a sequence's first output with tokens: time.perf_counter() when the engine's scheduler
    # got it, launched its first prefill chunk and had its first token on the host (the
    # server's TTFT breakdown; CLOCK_MONOTONIC on Linux, shared by the processes of a host).
    stamps: Optional[tuple[float, float, float]] = None
    error: Optional[FinishError] = None  # finish_reason "error"


class GrammarHealth(NamedTuple):
    """The engine's grammar service (engine/grammar/process.py), as the server reports it in
    its health service and metrics."""

    serving: bool    # up and warm: constrained requests are served
    restarts: int    # since the engine started
    detail: str      # why it is not serving ("" when it is)


class StepStat(NamedTuple):
    """One engine step as the host saw it (for the server's metrics): `seconds` from its launch,
    or from the previous step's result if that came later, to its own result on the host (so
    about its forward's time while the engine is busy; no device sync is added to measure it).
    `tokens`: an extend's prefill tokens, a decode's requests; `others`: requests holding a row
    that the step did not advance (for an extend, the decoding requests it held up);
    `draft_depth`: the draft levels a request a decode step verified (a chain's drafts, a
    tree's depth; adaptive speculation's choice, its width not reported; 0 for a plain step
    and an extend)."""

    extend: bool
    seconds: float
    tokens: int
    others: int
    draft_depth: int = 0


@dataclass
class GenerateOutput:
    """One finished sequence of `Engine.generate`."""

    token_ids: list[int]
    finish_reason: str
    text: Optional[str] = None
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[TopLogprobs]] = None
    prompt_logprobs: Optional[list[float]] = None
    prompt_top_logprobs: Optional[list[TopLogprobs]] = None
    matched_stop: Optional[int] = None
    prompt_tokens: int = 0
    num_verify_steps: int = 0
    num_accepted_drafts: int = 0
    cached_tokens: int = 0
    index: int = 0               # the sequence's index within its request (n > 1)
    error: Optional[FinishError] = None  # finish_reason "error"

    @property
    def accept_length(self) -> float:
        """Generated tokens per verify step (1.0 without speculation)."""
        return len(self.token_ids) / self.num_verify_steps if self.num_verify_steps else 1.0


class EngineLoad(NamedTuple):
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    mean_accept_length: float
    num_retractions: int  # running requests pushed back to the queue to free KV, since start
    kv_cached_tokens: int = 0          # KV slots the prefix cache holds (pinned or evictable)
    prefix_cache_hit_rate: float = 0.0  # prompt positions served from the cache / looked up, since start
