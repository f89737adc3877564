"""GenerateRequest bytes -> tokenized prompt + SamplingParams, refusing bad fields by name; and
the same prompt tokenizing (text or chat messages) and detokenizing for Tokenize/Detokenize.

Sizes are checked before anything that scales with them (tokenizing, scanning ids), so that an
oversized field costs a length lookup. Tokenizing is still slow for a long prompt: the server runs
all of this off the event loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, TypeVar, Union

from google.protobuf.message import DecodeError, Message

import dataclasses

from specserve.engine.config import MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from specserve.engine.wire import grammar_from_proto, sampling_from_proto
from specserve.proto import generate_pb2 as pb
from specserve.server.config import DEFAULT_MAX_NEW_TOKENS
from specserve.server.errors import InvalidRequest
from specserve.server.text.chat_template import ChatTemplate
from specserve.server.text.schema_checks import check_json_schema_text

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256   # the stop-string matcher rescans held-back text of this length
MAX_STOP_TOKEN_IDS = 256
# Text longer than this many UTF-8 bytes per token of max_prompt_tokens is refused without
# tokenizing it. Real text averages about 4 bytes per token (English prose; code with long
# indentation a little more), and even the longest tokens of common vocabularies (runs of spaces
# or symbols) are a few tens of bytes, so no prompt that fits max_prompt_tokens comes near it.
TEXT_BYTES_PER_TOKEN = 32

# A chat conversation as templates read it: {"role": ..., "content": ..., and any extra keys}.
Conversation = Sequence[Mapping[str, Any]]


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
    # The prompt's text when the caller asked for it back (OpenAI completions' echo): made
    # where the request is prepared (a tokenizer worker), off the event loop.
    echo_text: Optional[str] = None


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens_cap: int

    @property
    def max_text_bytes(self) -> int:
        return self.max_prompt_tokens * TEXT_BYTES_PER_TOKEN


def conversation_from_proto(messages: pb.ChatMessages) -> Conversation:
    return [{"role": m.role, "content": m.content} for m in messages.messages]


# The roles a conversation may hold: OpenAI's ("function": its deprecated tool result) and
# "ipython" (Llama 3's tool results, which its chat template renders).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def _check_messages(conversation: Conversation) -> None:
    """Each message has a known role and content; an assistant's tool calls stand for its
    content. (A gRPC message's content is a string, at worst empty, which is content.)"""
    for i, message in enumerate(conversation):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role: {role!r} is not a chat role (one of "
                                 f"{', '.join(CHAT_ROLES)})")
        if message.get("content") is not None:
            continue
        if role != "assistant":
            raise InvalidRequest(f"messages[{i}].content: required")
        if not message.get("tool_calls"):
            raise InvalidRequest(f"messages[{i}].content: required unless the message has "
                                 f"tool_calls")


def _optional_bool(message: Message, field: str) -> Optional[bool]:
    return getattr(message, field) if message.HasField(field) else None


class RequestValidator:
    """Checks requests and turns prompts into token ids, for Generate and Tokenize alike (so
    that Tokenize gives exactly the ids Generate would), on both fronts."""

    def __init__(self, tokenizer: Any, limits: RequestLimits,
                 chat_template: Optional["ChatTemplate"] = None,
                 reasoning_end_id: Optional[int] = None, reasoning: bool = False):
        self.tokenizer = tokenizer
        self.limits = limits
        self.chat_template = chat_template
        # With a reasoning parser, a chat request's grammar starts after this token (None: it
        # is not one token, and such requests are refused).
        self.reasoning = reasoning
        self.reasoning_end_id = reasoning_end_id

    def validate(self, request: pb.GenerateRequest, chat: bool = False) -> ValidatedRequest:
        """Check sizes, then tokenize and check every field; slow for a long text prompt.
        `chat`: the prompt is a conversation the caller rendered (the OpenAI chat API); a
        messages prompt is one too."""
        self._check_sizes(request)
        prompt_ids = self._prompt_ids(request)
        sampling = request.sampling
        stop_strings = tuple(sampling.stop)
        if any(not s for s in stop_strings):
            raise InvalidRequest("stop: stop strings must not be empty")
        if stop_strings and self.tokenizer is None:
            raise InvalidRequest("stop: this model has no tokenizer, so stop strings cannot match")
        self._check_ids("stop_token_ids", sampling.stop_token_ids)
        self._check_ids("logit_bias", sampling.logit_bias)
        self._check_max_new_tokens(sampling)
        try:
            params = sampling_from_proto(
                sampling, default_max_new_tokens=min(DEFAULT_MAX_NEW_TOKENS, self.limits.max_new_tokens_cap))
        except ValueError as e:  # SamplingParams names the field first
            raise InvalidRequest(str(e)) from None
        if request.HasField("structured_output"):
            params = self._with_grammar(params, request.structured_output,
                                        chat or request.WhichOneof("prompt") == "messages")
        return ValidatedRequest(prompt_ids, params, stop_strings)

    def _with_grammar(self, params: SamplingParams, msg: pb.StructuredOutput,
                      chat: bool) -> SamplingParams:
        """The request's grammar; on a chat request with a reasoning parser it starts after the
        end of the thinking. A JSON schema's cheap checks run here (schema_checks.py); parsing
        and compiling it (superlinear in a schema's nesting) is the engine's grammar process's,
        under its time budget, which fails a bad grammar by name with INVALID_ARGUMENT."""
        kind = msg.WhichOneof("grammar")
        if kind is not None and len(getattr(msg, kind) if kind != "json_object" else "") > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"structured_output.{kind}: longer than {MAX_GRAMMAR_CHARS} characters")
        if self.tokenizer is None:
            raise InvalidRequest("structured_output: this model has no tokenizer, which grammars need")
        after = None
        if chat and self.reasoning:
            if self.reasoning_end_id is None:
                raise InvalidRequest("structured_output: the reasoning parser's </think> is not one "
                                     "token of this model, so a grammar cannot start after it")
            after = self.reasoning_end_id
        try:
            grammar = grammar_from_proto(msg, after)
            if grammar is None:
                return params
            if grammar.kind == "json_schema":
                check_json_schema_text(grammar.source, "structured_output.json_schema")
            return dataclasses.replace(params, grammar=grammar)
        except ValueError as e:  # names the field (structured_output.*, ignore_eos, ...)
            raise InvalidRequest(str(e)) from None

    def _check_sizes(self, request: pb.GenerateRequest) -> None:
        """Refuse oversized fields from their lengths alone, before any per-element work."""
        limits = self.limits
        kind = request.WhichOneof("prompt")
        if kind == "text":
            self._check_text_size("text", request.text)
        elif kind == "messages":
            self._check_conversation_size(conversation_from_proto(request.messages))
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
        if len(sampling.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries are "
                                 f"allowed, got {len(sampling.logit_bias)}")
        if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} are allowed, "
                                 f"got {len(sampling.stop_token_ids)}")

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: set one of text, token_ids or messages")
        if kind == "token_ids":
            ids = list(request.token_ids.ids)  # _check_sizes bounded their number
            if not ids:
                raise InvalidRequest("token_ids: the prompt must not be empty")
            self._check_ids("token_ids", ids)
            return ids
        if kind == "text" and not request.text:
            raise InvalidRequest("text: the prompt must not be empty")
        prompt = request.text if kind == "text" else conversation_from_proto(request.messages)
        ids = self.tokenize_prompt(prompt, _optional_bool(request, "add_special_tokens"))
        if not ids:
            raise InvalidRequest(f"{kind}: the prompt tokenizes to no tokens")
        if len(ids) > self.limits.max_prompt_tokens:
            raise InvalidRequest(f"{kind}: the prompt has {len(ids)} tokens, over the server "
                                 f"limit max_prompt_tokens={self.limits.max_prompt_tokens}")
        return ids

    # --- prompts to ids and back (Generate, Tokenize, Detokenize) ----------------------------
    def tokenize_prompt(self, prompt: Union[str, Conversation],
                        add_special_tokens: Optional[bool] = None,
                        add_generation_prompt: bool = True, text_field: str = "text",
                        ) -> list[int]:
        """The ids of a text, or of a conversation rendered with the chat template; sizes are
        checked first. add_special_tokens unset: True for text, False for a conversation (the
        template writes its special tokens, a BOS for Llama 3, itself)."""
        if isinstance(prompt, str):
            field, text = text_field, prompt
            self._check_text_size(field, text)
        else:
            field, text = "messages", self.chat_prompt(prompt, add_generation_prompt)
        if self.tokenizer is None:
            raise InvalidRequest(f"{field}: this model has no tokenizer; send token ids")
        if add_special_tokens is None:
            add_special_tokens = field != "messages"
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def tokenize(self, request: pb.TokenizeRequest) -> list[int]:
        """The Tokenize RPC: the ids Generate would give the same prompt, without the
        max_prompt_tokens limit (counting tokens is the point)."""
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: set either text or messages")
        prompt = request.text if kind == "text" else conversation_from_proto(request.messages)
        generation_prompt = _optional_bool(request, "add_generation_prompt")
        return self.tokenize_prompt(prompt, _optional_bool(request, "add_special_tokens"),
                                    generation_prompt is not False)

    def chat_prompt(self, conversation: Conversation, add_generation_prompt: bool = True,
                    tools: Optional[list] = None) -> str:
        """A conversation rendered with the model's chat template; sizes are checked before and
        after rendering (a template can add text), all refusals name `messages`."""
        if not conversation:
            raise InvalidRequest("messages: must not be empty")
        if self.chat_template is None:
            raise InvalidRequest("messages: this model has no chat template (no chat_template "
                                 "in its tokenizer_config.json); send text")
        self._check_conversation_size(conversation)
        _check_messages(conversation)
        text = self.chat_template.render(conversation, add_generation_prompt, tools)
        self._check_text_size("messages", text)
        return text

    def detokenize(self, ids: Sequence[int], field: str = "token_ids") -> str:
        if self.tokenizer is None:
            raise InvalidRequest(f"{field}: this model has no tokenizer")
        most = self.limits.max_prompt_tokens + self.limits.max_new_tokens_cap
        if len(ids) > most:
            raise InvalidRequest(f"{field}: at most max_prompt_tokens + max_new_tokens_cap = "
                                 f"{most} ids are accepted, got {len(ids)}")
        bad = next((t for t in ids if not 0 <= t < self.limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{field}: token id {bad} is not in [0, vocab_size="
                                 f"{self.limits.vocab_size})")
        return self.tokenizer.decode(list(ids))

    def _check_text_size(self, field: str, text: str) -> None:
        limit = self.limits.max_text_bytes
        # A character is at least one byte: counting characters settles most cases without
        # encoding the text.
        if len(text) > limit or len(text.encode()) > limit:
            raise InvalidRequest(
                f"{field}: longer than the server limit of {limit} UTF-8 bytes "
                f"({TEXT_BYTES_PER_TOKEN} per token of max_prompt_tokens="
                f"{self.limits.max_prompt_tokens})")

    def _check_conversation_size(self, conversation: Conversation) -> None:
        limit = self.limits.max_text_bytes
        size = 0
        for message in conversation:
            for key in ("role", "content"):
                value = message.get(key)
                size += len(value.encode()) if isinstance(value, str) else 0
            if size > limit:
                raise InvalidRequest(f"messages: the roles and contents are longer than the "
                                     f"server limit of {limit} UTF-8 bytes")

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
