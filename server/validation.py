"""GenerateRequest -> tokenized prompt + SamplingParams, refusing bad fields by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from specserve.engine.config import SamplingParams
from specserve.server.config import DEFAULT_MAX_NEW_TOKENS
from specserve.server.proto import generate_pb2 as pb

MAX_STOP_STRINGS = 16

# SamplingParams fields that the API carries as `optional` scalars of the same name; an unset
# one keeps the SamplingParams default, which is what generate.proto documents.
_OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                             "min_new_tokens", "ignore_eos", "seed", "logprobs")


class InvalidRequest(ValueError):
    """A request field is invalid or over a server limit; the message starts with the field."""


@dataclass(frozen=True)
class ValidatedRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop_strings: tuple[str, ...]


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens_cap: int


class RequestValidator:
    def __init__(self, tokenizer: Any, limits: RequestLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    def validate(self, request: pb.GenerateRequest) -> ValidatedRequest:
        prompt_ids = self._prompt_ids(request)
        sampling = request.sampling
        stop_strings = tuple(sampling.stop)
        if len(stop_strings) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, "
                                 f"got {len(stop_strings)}")
        if any(not s for s in stop_strings):
            raise InvalidRequest("stop: stop strings must not be empty")
        if stop_strings and self.tokenizer is None:
            raise InvalidRequest("stop: this model has no tokenizer, so stop strings cannot match")
        self._check_ids("stop_token_ids", sampling.stop_token_ids)
        kwargs = {name: getattr(sampling, name) for name in _OPTIONAL_SAMPLING_FIELDS
                  if sampling.HasField(name)}
        kwargs["max_new_tokens"] = self._max_new_tokens(sampling)
        kwargs["stop_token_ids"] = tuple(sampling.stop_token_ids)
        try:
            params = SamplingParams(**kwargs)
        except ValueError as e:  # SamplingParams names the field first
            raise InvalidRequest(str(e)) from None
        return ValidatedRequest(prompt_ids, params, stop_strings)

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: set either text or token_ids")
        if kind == "text":
            if not request.text:
                raise InvalidRequest("text: the prompt must not be empty")
            if self.tokenizer is None:
                raise InvalidRequest("text: this model has no tokenizer; send token_ids")
            ids = self.tokenizer.encode(request.text)
            if not ids:
                raise InvalidRequest("text: the prompt tokenizes to no tokens")
        else:
            ids = list(request.token_ids.ids)
            if not ids:
                raise InvalidRequest("token_ids: the prompt must not be empty")
            self._check_ids("token_ids", ids)
        if len(ids) > self.limits.max_prompt_tokens:
            raise InvalidRequest(f"{kind}: the prompt has {len(ids)} tokens, over the server limit "
                                 f"max_prompt_tokens={self.limits.max_prompt_tokens}")
        return ids

    def _check_ids(self, field: str, ids) -> None:
        bad: Optional[int] = next((t for t in ids if t >= self.limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{field}: token id {bad} is not below vocab_size="
                                 f"{self.limits.vocab_size}")

    def _max_new_tokens(self, sampling: pb.SamplingParams) -> int:
        cap = self.limits.max_new_tokens_cap
        if not sampling.HasField("max_new_tokens"):
            return min(DEFAULT_MAX_NEW_TOKENS, cap)
        if sampling.max_new_tokens > cap:
            raise InvalidRequest(f"max_new_tokens: {sampling.max_new_tokens} is over the server "
                                 f"limit max_new_tokens_cap={cap}")
        return sampling.max_new_tokens
