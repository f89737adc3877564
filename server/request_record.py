"""What one request did, filled in as it runs: the source of its access-log line and of the
per-request metrics (server/ops/metrics.py), for the gRPC and the HTTP front alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specserve.proto import generate_pb2 as pb

_FINISH_PREFIX = "FINISH_REASON_"


def finish_reason_name(reason: int) -> str:
    """"stop", "length", "abort" or "unspecified": the names of the SDK and the HTTP API."""
    return pb.FinishReason.Name(reason).removeprefix(_FINISH_PREFIX).lower()


@dataclass
class RequestRecord:
    """Times are time.perf_counter() readings; None until the event happened."""

    rid: str
    arrived: float
    admitted: Optional[float] = None       # past the admission check (not refused as full)
    first_output: Optional[float] = None   # the engine's first output for it (after prefill)
    first_token: Optional[float] = None    # the first token streamed to the client
    last_token: Optional[float] = None
    ended: Optional[float] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0             # streamed to the client
    cached_tokens: int = 0                 # prompt tokens served from the engine's prefix cache
    verify_steps: int = 0                  # speculative verify forwards it took part in
    accepted_drafts: int = 0
    accept_length: Optional[float] = None  # None without speculative decoding
    finish_reason: Optional[str] = None    # None when it ended without finishing (refused, ...)
    status: str = "OK"                     # a gRPC status code name, as the metrics count them

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

        return (f"request {self.rid} status={self.status} "
                f"finish_reason={self.finish_reason or '-'} "
                f"prompt_tokens={self.prompt_tokens} cached_tokens={self.cached_tokens} "
                f"completion_tokens={self.completion_tokens} "
                f"ttft={seconds(self.ttft)} duration={seconds(self.duration)} "
                f"accept_length="
                f"{'-' if self.accept_length is None else f'{self.accept_length:.2f}'}")
