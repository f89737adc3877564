"""Shared by Client and AsyncClient: request building, response conversion, channel setup."""
from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import grpc

from specserve.clients.errors import InvalidArgument
from specserve.clients.types import (Chunk, GenerateResult, PromptTokenLogprob, SpecStats,
                                     TokenLogprob, Usage)
from specserve.proto import generate_pb2 as pb

_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                   pb.FINISH_REASON_ABORT: "abort"}
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_FLOAT32_MAX = 3.4028234663852886e38


class _BadValue(Exception):
    """What is wrong with a value; _checked puts the argument's name in front."""


# A check turns a caller's value into one that its protobuf field can hold, or raises _BadValue.
_Check = Callable[[object], object]


def _integer(low: int, high: int) -> _Check:
    def check(value: object) -> int:
        # bool is an int subclass, but True for a token count is a caller's mistake.
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _BadValue(f"expected an int, got {type(value).__name__}")
        if not low <= value <= high:
            raise _BadValue(f"{value} is out of range [{low}, {high}]")
        return int(value)
    return check


_uint32 = _integer(0, 2**32 - 1)
_int32 = _integer(-2**31, 2**31 - 1)
_uint64 = _integer(0, 2**64 - 1)


def _float32(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _BadValue(f"expected a number, got {type(value).__name__}")
    number = float(value)
    # protobuf stores nan, inf and values past the float32 range (as inf) without complaint.
    if not math.isfinite(number) or abs(number) > _FLOAT32_MAX:
        raise _BadValue(f"{number} is not a finite float32")
    return number


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _BadValue(f"expected a bool, got {type(value).__name__}")
    return value


def _utf8_str(value: object) -> str:
    if not isinstance(value, str):
        raise _BadValue(f"expected a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad decode
        raise _BadValue(f"not valid UTF-8 at index {e.start}: {e.reason}") from None
    return value


def _list_of(item: _Check, lone: Optional[type] = None) -> _Check:
    """A list, tuple or other iterable of items; a value of type `lone` stands for a one-item
    list (stop="\\n")."""
    def check(value: object) -> list:
        if lone is not None and isinstance(value, lone):
            value = [value]
        if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Iterable):
            raise _BadValue(f"expected a list, got {type(value).__name__}")
        items = []
        for index, element in enumerate(value):
            try:
                items.append(item(element))
            except _BadValue as e:
                raise _BadValue(f"item {index}: {e}") from None
        return items
    return check


def _logit_bias(value: object) -> dict[int, float]:
    """{token id: bias}."""
    if not isinstance(value, Mapping):
        raise _BadValue(f"expected a dict of token id -> bias, got {type(value).__name__}")
    bias = {}
    for token, number in value.items():
        try:
            bias[_uint32(token)] = _float32(number)
        except _BadValue as e:
            raise _BadValue(f"entry {token!r}: {e}") from None
    return bias


# Every sampling option a caller may pass to generate()/generate_stream(), with the check for
# its field in generate.proto. Only what the field can carry is checked here; what a value means
# (top_p in (0, 1], limits) is the server's to judge, with the same InvalidArgument.
_SAMPLING_CHECKS: dict[str, _Check] = {
    "max_new_tokens": _uint32, "min_new_tokens": _uint32, "temperature": _float32,
    "top_p": _float32, "top_k": _int32, "min_p": _float32, "repetition_penalty": _float32,
    "seed": _uint64, "stop": _list_of(_utf8_str, lone=str),
    "stop_token_ids": _list_of(_uint32, lone=numbers.Integral), "ignore_eos": _bool,
    "logprobs": _bool, "top_logprobs": _uint32, "prompt_logprobs": _uint32,
    "presence_penalty": _float32, "frequency_penalty": _float32, "logit_bias": _logit_bias,
    "n": _uint32,
}
_GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")


def _structured_output(value: object) -> pb.StructuredOutput:
    """{"json_schema": schema (a dict or JSON text)} | {"regex": str} | {"ebnf": str} |
    {"json_object": True}: GenerateRequest.structured_output."""
    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in _GRAMMAR_KINDS:
        raise _BadValue(f"expected a dict with one of {', '.join(_GRAMMAR_KINDS)}, got {value!r}")
    kind, source = next(iter(value.items()))
    if kind == "json_object":
        return pb.StructuredOutput(json_object=_bool(source))
    if kind == "json_schema" and isinstance(source, Mapping):
        source = json.dumps(source)
    return pb.StructuredOutput(**{kind: _utf8_str(source)})


# Options of generate()/generate_stream() that are request fields rather than sampling ones.
_REQUEST_CHECKS: dict[str, _Check] = {"structured_output": _structured_output}
SAMPLING_OPTIONS = tuple(_SAMPLING_CHECKS) + tuple(_REQUEST_CHECKS)
_token_ids = _list_of(_uint32)


def _chat_message(value: object) -> pb.ChatMessage:
    if not isinstance(value, Mapping):
        raise _BadValue(f"expected a dict with 'role' and 'content', got {type(value).__name__}")
    unknown = set(value) - {"role", "content"}
    if unknown:
        raise _BadValue(f"unknown key(s) {', '.join(sorted(map(str, unknown)))}; the gRPC API "
                        f"carries role and content only")
    fields = {}
    for key in ("role", "content"):
        if key not in value:
            raise _BadValue(f"missing {key!r}")
        try:
            fields[key] = _utf8_str(value[key])
        except _BadValue as e:
            raise _BadValue(f"{key}: {e}") from None
    return pb.ChatMessage(**fields)


# A conversation: [{"role": "user", "content": "Hi"}, ...].
_chat_messages = _list_of(_chat_message)
ChatMessages = Sequence[Mapping[str, str]]


def _invalid(field: str, problem: str) -> InvalidArgument:
    # The same error (and details format) as a server-side refusal, so callers handle one type.
    return InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def _checked(field: str, value: object, check: _Check):
    try:
        return check(value)
    except _BadValue as e:
        raise _invalid(field, str(e)) from None


def build_request(prompt: Optional[str], prompt_token_ids: Optional[Sequence[int]],
                  sampling: dict, messages: Optional[ChatMessages] = None,
                  add_special_tokens: Optional[bool] = None) -> pb.GenerateRequest:
    """The GenerateRequest for a generate()/generate_stream() call. TypeError for a wrong set of
    arguments; InvalidArgument, details starting with the argument's name, for a value its field
    cannot carry. An option left out (or None) is not sent, so the server applies the default
    documented in generate.proto."""
    if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
        raise TypeError("give exactly one of prompt, prompt_token_ids or messages")
    unknown = set(sampling) - set(SAMPLING_OPTIONS)
    if unknown:
        raise TypeError(f"unknown sampling option(s): {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(SAMPLING_OPTIONS)}")
    request = pb.GenerateRequest()
    if prompt_token_ids is not None:
        request.token_ids.ids.extend(_checked("prompt_token_ids", prompt_token_ids, _token_ids))
    elif messages is not None:
        request.messages.messages.extend(_checked("messages", messages, _chat_messages))
    else:
        _set_prompt_text(request, prompt)
    if add_special_tokens is not None:
        request.add_special_tokens = _checked("add_special_tokens", add_special_tokens, _bool)
    for name, value in sampling.items():
        if value is None:
            continue
        if name in _REQUEST_CHECKS:
            getattr(request, name).CopyFrom(_checked(name, value, _REQUEST_CHECKS[name]))
            continue
        value = _checked(name, value, _SAMPLING_CHECKS[name])
        if isinstance(value, list):  # a repeated field
            getattr(request.sampling, name).extend(value)
        elif isinstance(value, dict):  # a map field
            getattr(request.sampling, name).update(value)
        else:
            setattr(request.sampling, name, value)
    return request


def build_tokenize_request(prompt: Optional[str], messages: Optional[ChatMessages],
                           add_special_tokens: Optional[bool],
                           add_generation_prompt: Optional[bool]) -> pb.TokenizeRequest:
    """The TokenizeRequest for a tokenize() call; errors as for build_request."""
    if (prompt is None) == (messages is None):
        raise TypeError("give exactly one of prompt or messages")
    request = pb.TokenizeRequest()
    if messages is not None:
        request.messages.messages.extend(_checked("messages", messages, _chat_messages))
    else:
        _set_prompt_text(request, prompt)
    for name, value in (("add_special_tokens", add_special_tokens),
                        ("add_generation_prompt", add_generation_prompt)):
        if value is not None:
            setattr(request, name, _checked(name, value, _bool))
    return request


def build_detokenize_request(token_ids: Sequence[int]) -> pb.DetokenizeRequest:
    return pb.DetokenizeRequest(token_ids=_checked("token_ids", token_ids, _token_ids))


def _set_prompt_text(request: Union[pb.GenerateRequest, pb.TokenizeRequest],
                     prompt: object) -> None:
    if isinstance(prompt, (list, tuple)):
        raise _invalid("prompt", f"expected a str, got {type(prompt).__name__} "
                                 f"(token ids go in prompt_token_ids, a conversation in messages)")
    request.text = _checked("prompt", prompt, _utf8_str)


def _token(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, msg.text)


def chunk_from_proto(msg: pb.GenerateChunk) -> Chunk:
    common = dict(
        token_ids=list(msg.token_ids), text=msg.text, index=msg.index,
        logprobs=list(msg.logprobs) or None, top_logprobs=[[_token(c) for c in top.candidates] for top in msg.top_logprobs] or None,
        prompt_logprobs=[PromptTokenLogprob(p.token_id, p.text,
                                            p.logprob if p.HasField("logprob") else None,
                                            [_token(t) for t in p.top])
                         for p in msg.prompt_logprobs] or None)
    if not msg.HasField("finish"):
        return Chunk(**common)
    finish = msg.finish
    matched_kind = finish.WhichOneof("matched_stop")
    return Chunk(
        **common,
        finish_reason=_FINISH_REASONS.get(finish.reason, "unspecified"),
        matched_stop=getattr(finish, matched_kind) if matched_kind else None,
        usage=Usage(finish.usage.prompt_tokens, finish.usage.completion_tokens,
                    finish.usage.cached_tokens),
        spec=SpecStats(finish.spec.verify_steps, finish.spec.accepted_drafts,
                       finish.spec.accept_length) if finish.HasField("spec") else None)


def one_or_all(results: list[GenerateResult], sampling: dict
               ) -> Union[GenerateResult, list[GenerateResult]]:
    """What generate() returns: the result, or with n > 1 every sequence's."""
    if sampling.get("n") in (None, 1):
        return results[0]
    return results


def results_from_chunks(chunks: Iterable[Chunk]) -> list[GenerateResult]:
    """One result per sequence (Chunk.index) of a stream, in index order."""
    by_index: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).append(chunk)
    return [_result(index, by_index[index]) for index in sorted(by_index)]


def _result(index: int, chunks: list[Chunk]) -> GenerateResult:
    text, token_ids, logprobs, top, prompt = [], [], [], [], None
    for chunk in chunks:
        text.append(chunk.text)
        token_ids += chunk.token_ids
        logprobs += chunk.logprobs or []
        top += chunk.top_logprobs or []
        prompt = prompt or chunk.prompt_logprobs
    last = chunks[-1]
    if last.finish_reason is None:
        raise RuntimeError(f"the stream ended without a final chunk for sequence {index}")
    return GenerateResult(text="".join(text), token_ids=token_ids, finish_reason=last.finish_reason,
                          usage=last.usage, matched_stop=last.matched_stop,
                          logprobs=logprobs or None, top_logprobs=top or None,
                          prompt_logprobs=prompt, spec=last.spec, index=index)


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def channel_credentials(tls: bool, root_cert: Union[str, Path, bytes, None]
                        ) -> Optional[grpc.ChannelCredentials]:
    """None for plaintext; TLS credentials trusting root_cert (PEM bytes or a path), or the
    system roots when root_cert is None and tls is True."""
    if root_cert is None and not tls:
        return None
    if isinstance(root_cert, (str, Path)):
        root_cert = Path(root_cert).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=root_cert)
