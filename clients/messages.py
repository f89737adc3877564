"""Shared by Client and AsyncClient: request building, response conversion, channel setup."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import grpc

from specserve.clients.types import Chunk, GenerateResult, SpecStats, Usage
from specserve.server.proto import generate_pb2 as pb

# Sampling options a caller may pass to generate()/generate_stream(); an option left out (or
# None) is not sent, so the server applies the default documented in generate.proto.
SAMPLING_OPTIONS = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs")

_REPEATED_OPTIONS = ("stop", "stop_token_ids")
_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                   pb.FINISH_REASON_ABORT: "abort"}
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def build_request(prompt: Optional[str], prompt_token_ids: Optional[Sequence[int]],
                  sampling: dict) -> pb.GenerateRequest:
    if (prompt is None) == (prompt_token_ids is None):
        raise TypeError("give exactly one of prompt or prompt_token_ids")
    unknown = set(sampling) - set(SAMPLING_OPTIONS)
    if unknown:
        raise TypeError(f"unknown sampling option(s): {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(SAMPLING_OPTIONS)}")
    request = pb.GenerateRequest()
    if prompt is not None:
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt_token_ids)
    for name, value in sampling.items():
        if value is None:
            continue
        if name in _REPEATED_OPTIONS:
            if isinstance(value, (str, int)):
                value = [value]
            getattr(request.sampling, name).extend(value)
        else:
            setattr(request.sampling, name, value)
    return request


def chunk_from_proto(msg: pb.GenerateChunk) -> Chunk:
    if not msg.HasField("finish"):
        return Chunk(token_ids=list(msg.token_ids), text=msg.text,
                     logprobs=list(msg.logprobs) or None)
    finish = msg.finish
    matched_kind = finish.WhichOneof("matched_stop")
    return Chunk(
        token_ids=list(msg.token_ids), text=msg.text, logprobs=list(msg.logprobs) or None,
        finish_reason=_FINISH_REASONS.get(finish.reason, "unspecified"),
        matched_stop=getattr(finish, matched_kind) if matched_kind else None,
        usage=Usage(finish.usage.prompt_tokens, finish.usage.completion_tokens),
        spec=SpecStats(finish.spec.verify_steps, finish.spec.accepted_drafts,
                       finish.spec.accept_length) if finish.HasField("spec") else None)


def result_from_chunks(chunks: Iterable[Chunk]) -> GenerateResult:
    text, token_ids, logprobs, last = [], [], [], None
    for chunk in chunks:
        text.append(chunk.text)
        token_ids += chunk.token_ids
        logprobs += chunk.logprobs or []
        last = chunk
    if last is None or last.finish_reason is None:
        raise RuntimeError("the stream ended without a final chunk")
    return GenerateResult(text="".join(text), token_ids=token_ids, finish_reason=last.finish_reason,
                          usage=last.usage, matched_stop=last.matched_stop,
                          logprobs=logprobs or None, spec=last.spec)


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
