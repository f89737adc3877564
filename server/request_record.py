"""What one request did, filled in as it runs: the source of its access-log line and of the
per-request metrics (server/ops/metrics.py), for the gRPC and the HTTP front alike."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specserve.proto import generate_pb2 as pb

_FINISH_PREFIX = "FINISH_REASON_"


def finish_reason_name(reason: int) -> str:
    """"stop", "length", "abort" or "unspecified": the names of the SDK and the HTTP API."""
    return pb.FinishReason.Name(reason).removeprefix(_FINISH_PREFIX).lower()


# Where a request's time to first token goes: (stage, from, to), RequestRecord fields in order.
TTFT_STAGES = (
    ("prepare", "arrived", "prepared"),       # admission, the tokenizer pool's queue, tokenizing
    ("submit", "prepared", "submitted"),      # on the loop: handing it to the engine client
    ("to_engine", "submitted", "engine_received"),  # the socket, and the engine's step in progress
    ("engine_queue", "engine_received", "engine_admitted"),  # waiting to be admitted (policy)
    ("prefill", "engine_admitted", "engine_first_token"),  # its extend step (and, overlapped, the step ahead)
    ("to_server", "engine_first_token", "first_output"),  # engine send, reader, detokenizer worker
    ("to_consumer", "first_output", "first_token"),  # the event loop waking the call
    ("write", "first_token", "first_written"),  # the front writing the first chunk
)
_CROSS_CLOCK = frozenset({"to_engine", "to_server"})


@dataclass
class RequestRecord:
    """Times are time.perf_counter() readings; None until the event happened."""

    rid: str
    arrived: float
    admitted: Optional[float] = None       # past the admission check (not refused as full)
    prepared: Optional[float] = None       # its text prepared (tokenizer worker done)
    submitted: Optional[float] = None      # handed to the engine client (just before its send)
    # The engine's stamps (its process's perf_counter(): CLOCK_MONOTONIC on Linux, the same
    # clock as the server's on one host): added to its scheduler, first prefill chunk
    # launched, first token on the engine's host side.
    engine_received: Optional[float] = None
    engine_admitted: Optional[float] = None
    engine_first_token: Optional[float] = None
    first_output: Optional[float] = None   # the engine's first output for it, on the event loop
    first_token: Optional[float] = None    # the first token taken by the call (its TTFT)
    first_written: Optional[float] = None  # the first chunk written by the front
    last_token: Optional[float] = None
    ended: Optional[float] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0             # streamed to the client
    cached_tokens: int = 0                 # prompt tokens served from the engine's prefix cache
    verify_steps: int = 0                  # speculative verify forwards it took part in
    accepted_drafts: int = 0
    accept_length: Optional[float] = None  # None without speculative decoding
    # Per choice (sequence), once it finished: "stop", "length", or "error" (it failed); None
    # while it runs, or when it ended without finishing (refused, cancelled, another failed).
    finish_reasons: list[Optional[str]] = field(default_factory=list)
    status: str = "OK"                     # a gRPC status code name, as the metrics count them

    @property
    def complete(self) -> bool:
        """Every choice finished (a stream the client closes after that is not cancelled)."""
        return bool(self.finish_reasons) and None not in self.finish_reasons

    def ttft_stages(self) -> dict[str, float]:
        """Seconds spent in each stage up to the first chunk written (TTFT_STAGES), those whose
        two stamps are both known. An engine on another host has a clock of its own: the
        stages that cross between the two clocks are then left out (they would be negative)."""
        stages = {}
        for name, start, end in TTFT_STAGES:
            a, b = getattr(self, start), getattr(self, end)
            if a is not None and b is not None and (b >= a or name not in _CROSS_CLOCK):
                stages[name] = b - a
        return stages

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.arrived

    @property
    def duration(self) -> Optional[float]:
        return None if self.ended is None else self.ended - self.arrived

    @property
    def time_per_output_token(self) -> Optional[float]:
        """Mean time per token after the first, as the client saw them arrive."""
        if self.first_token is None or self.completion_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.completion_tokens - 1)

    def access_log_line(self) -> str:
        """One line per request, key=value so that log tools can parse it."""
        def seconds(value: Optional[float]) -> str:
            return "-" if value is None else f"{value:.3f}s"

        stages = ",".join(f"{name}:{1000 * t:.2f}" for name, t in self.ttft_stages().items())
        return (f"request {self.rid} status={self.status} "
                f"finish_reason={','.join(r or '-' for r in self.finish_reasons) or '-'} "
                f"prompt_tokens={self.prompt_tokens} cached_tokens={self.cached_tokens} "
                f"completion_tokens={self.completion_tokens} "
                f"ttft={seconds(self.ttft)} duration={seconds(self.duration)} "
                f"accept_length="
                f"{'-' if self.accept_length is None else f'{self.accept_length:.2f}'} "
                f"ttft_stages_ms={stages or '-'}")
