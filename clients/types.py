"""What the SDK returns: stream chunks and finished generations."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, those the server's prefix cache served


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding counters of one request (only when the server runs speculation)."""

    verify_steps: int
    accepted_drafts: int
    accept_length: float  # generated tokens per verify step


@dataclass(frozen=True)
class Chunk:
    """One streamed piece: new token ids and the text they complete. The finish fields are set
    on the last chunk only."""

    token_ids: list[int]
    text: str
    logprobs: Optional[list[float]] = None
    finish_reason: Optional[str] = None   # "stop" | "length" | "abort"
    matched_stop: Union[int, str, None] = None  # the stop token id or stop string that matched
    usage: Optional[Usage] = None
    spec: Optional[SpecStats] = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    matched_stop: Union[int, str, None] = None
    logprobs: Optional[list[float]] = None
    spec: Optional[SpecStats] = None
