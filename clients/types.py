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
class TokenLogprob:
    token_id: int
    logprob: float
    text: str       # the token decoded on its own


@dataclass(frozen=True)
class PromptTokenLogprob:
    """A prompt token with its log-probability (None for the first) and the most likely tokens
    at its position (empty unless prompt_logprobs > 0)."""

    token_id: int
    text: str
    logprob: Optional[float]
    top: list[TokenLogprob]


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of one sequence: new token ids and the text they complete. The finish
    fields are set on the sequence's last chunk only (with n > 1, each sequence has one)."""

    token_ids: list[int]
    text: str
    index: int = 0   # the sequence (0 .. n - 1) this chunk belongs to
    logprobs: Optional[list[float]] = None
    # Per token, the top_logprobs most likely tokens at its position (most likely first).
    top_logprobs: Optional[list[list[TokenLogprob]]] = None
    # First chunk only, with prompt_logprobs set: every prompt token.
    prompt_logprobs: Optional[list[PromptTokenLogprob]] = None
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
    top_logprobs: Optional[list[list[TokenLogprob]]] = None
    prompt_logprobs: Optional[list[PromptTokenLogprob]] = None
    spec: Optional[SpecStats] = None
    index: int = 0   # the sequence (0 .. n - 1)
