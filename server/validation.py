"""GenerateRequest bytes -> tokenized prompt + SamplingParams, refusing bad fields by name.

Sizes are checked before anything that scales with them (tokenizing, scanning ids), so that an
oversized field costs a length lookup. Tokenizing is still slow for a long prompt: the server runs
all of this off the event loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, TypeVar

from google.protobuf.message import DecodeError, Message

from specserve.engine.config import SamplingParams
from specserve.engine.wire import sampling_from_proto
from specserve.server.config import DEFAULT_MAX_NEW_TOKENS
from specserve.proto import generate_pb2 as pb

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256   # the stop-string matcher rescans held-back text of this length
MAX_STOP_TOKEN_IDS = 256
# Text longer than this many UTF-8 bytes per token of max_prompt_tokens is refused without
# tokenizing it. Real text averages about 4 bytes per token (English prose; code with long
# indentation a little more), and even the longest tokens of common vocabularies (runs of spaces
# or symbols) are a few tens of bytes, so no prompt that fits max_prompt_tokens comes near it.
TEXT_BYTES_PER_TOKEN = 32



class InvalidRequest(ValueError):
    """A request field is invalid or over a server limit; the message starts with the field
    ("request" for a message that cannot be parsed)."""

    @property
    def field(self) -> str:
        return str(self).partition(":")[0]


M = TypeVar("M", bound=Message)


def parse_request(message_class: type[M], data: bytes) -> M:
    """Parse a request's bytes (the server registers its handlers without deserializers, so
    that corrupt bytes or invalid UTF-8 in a string field are refused here, by name)."""
    try:
        return message_class.FromString(data)
    except DecodeError as e:
        # protobuf says "Error parsing message with type '...': <what was wrong>".
        reason = str(e).rpartition(": ")[2] or "corrupt bytes"
        raise InvalidRequest(f"request: not a valid {message_class.DESCRIPTOR.name} message "
                             f"({reason})") from None


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

    @property
    def max_text_bytes(self) -> int:
        return self.max_prompt_tokens * TEXT_BYTES_PER_TOKEN


class RequestValidator:
    def __init__(self, tokenizer: Any, limits: RequestLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    def validate(self, request: pb.GenerateRequest) -> ValidatedRequest:
        """Check sizes, then tokenize and check every field; slow for a long text prompt."""
        self._check_sizes(request)
        prompt_ids = self._prompt_ids(request)
        sampling = request.sampling
        stop_strings = tuple(sampling.stop)
        if any(not s for s in stop_strings):
            raise InvalidRequest("stop: stop strings must not be empty")
        if stop_strings and self.tokenizer is None:
            raise InvalidRequest("stop: this model has no tokenizer, so stop strings cannot match")
        self._check_ids("stop_token_ids", sampling.stop_token_ids)
        self._check_max_new_tokens(sampling)
        try:
            params = sampling_from_proto(
                sampling, default_max_new_tokens=min(DEFAULT_MAX_NEW_TOKENS, self.limits.max_new_tokens_cap))
        except ValueError as e:  # SamplingParams names the field first
            raise InvalidRequest(str(e)) from None
        return ValidatedRequest(prompt_ids, params, stop_strings)

    def _check_sizes(self, request: pb.GenerateRequest) -> None:
        """Refuse oversized fields from their lengths alone, before any per-element work."""
        limits = self.limits
        if request.WhichOneof("prompt") == "text":
            text = request.text
            # A character is at least one byte: counting characters settles most cases without
            # encoding the text.
            if len(text) > limits.max_text_bytes or len(text.encode()) > limits.max_text_bytes:
                raise InvalidRequest(
                    f"text: longer than the server limit of {limits.max_text_bytes} UTF-8 bytes "
                    f"({TEXT_BYTES_PER_TOKEN} per token of max_prompt_tokens="
                    f"{limits.max_prompt_tokens})")
        num_ids = len(request.token_ids.ids)
        if num_ids > limits.max_prompt_tokens:
            raise InvalidRequest(f"token_ids: the prompt has {num_ids} tokens, over the server "
                                 f"limit max_prompt_tokens={limits.max_prompt_tokens}")
        sampling = request.sampling
        if len(sampling.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, "
                                 f"got {len(sampling.stop)}")
        longest = max((len(s) for s in sampling.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"stop: a stop string may have at most {MAX_STOP_STRING_CHARS} "
                                 f"characters, got {longest}")
        if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} are allowed, "
                                 f"got {len(sampling.stop_token_ids)}")

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: set either text or token_ids")
        if kind == "text":
            if not request.text:
                raise InvalidRequest("text: the prompt must not be empty")
            if self.tokenizer is None:
                raise InvalidRequest("text: this model has no tokenizer; send token_ids")
            add_special_tokens = (request.add_special_tokens
                                  if request.HasField("add_special_tokens") else True)
            ids = self.tokenizer.encode(request.text, add_special_tokens=add_special_tokens)
            if not ids:
                raise InvalidRequest("text: the prompt tokenizes to no tokens")
            if len(ids) > self.limits.max_prompt_tokens:
                raise InvalidRequest(f"text: the prompt has {len(ids)} tokens, over the server "
                                     f"limit max_prompt_tokens={self.limits.max_prompt_tokens}")
            return ids
        ids = list(request.token_ids.ids)  # _check_sizes bounded their number
        if not ids:
            raise InvalidRequest("token_ids: the prompt must not be empty")
        self._check_ids("token_ids", ids)
        return ids

    def _check_ids(self, field: str, ids) -> None:
        bad: Optional[int] = next((t for t in ids if t >= self.limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{field}: token id {bad} is not below vocab_size="
                                 f"{self.limits.vocab_size}")

    def _check_max_new_tokens(self, sampling: pb.SamplingParams) -> None:
        cap = self.limits.max_new_tokens_cap
        if sampling.HasField("max_new_tokens") and sampling.max_new_tokens > cap:
            raise InvalidRequest(f"max_new_tokens: {sampling.max_new_tokens} is over the server "
                                 f"limit max_new_tokens_cap={cap}")
