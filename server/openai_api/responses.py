"""OpenAI response bodies from the core's GenerateChunks: whole responses, stream chunks and
server-sent-event framing, for /v1/completions and /v1/chat/completions."""
from __future__ import annotations

import json
import time
from typing import Optional

from specserve.proto import generate_pb2 as pb

_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                   pb.FINISH_REASON_ABORT: "abort"}

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One server-sent event: a `data:` line of compact JSON and a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def finish_reason(chunk: pb.GenerateChunk) -> Optional[str]:
    return _FINISH_REASONS.get(chunk.finish.reason) if chunk.HasField("finish") else None


def usage(chunk: pb.GenerateChunk) -> dict:
    """The usage of a request's last chunk (the one with `finish`)."""
    prompt, completion = chunk.finish.usage.prompt_tokens, chunk.finish.usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": chunk.finish.usage.cached_tokens}}


class ResponseFormat:
    """The shapes of one request's responses; chat and completions differ only in the object
    names and in where the text goes (`message`/`delta` content or `text`)."""

    def __init__(self, rid: str, model: str, chat: bool):
        self.chat = chat
        self._head = {"id": rid, "created": int(time.time()), "model": model}

    def response(self, text: str, finish: pb.GenerateChunk) -> dict:
        """The whole response of a non-streaming request."""
        choice: dict = {"index": 0, "finish_reason": finish_reason(finish)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            choice["logprobs"] = None
        return {**self._head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [choice], "usage": usage(finish)}

    def first_chunk(self) -> Optional[dict]:
        """Chat streams open with the assistant's role (OpenAI's first delta); None otherwise."""
        if not self.chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def chunk(self, chunk: pb.GenerateChunk) -> Optional[dict]:
        """The stream chunk for a core chunk; None when it has neither text nor a finish."""
        reason = finish_reason(chunk)
        if not chunk.text and reason is None:
            return None
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": reason}
        if self.chat:
            choice["delta"] = {"content": chunk.text} if chunk.text else {}
        else:
            choice["text"] = chunk.text
        return self._chunk(choice)

    def usage_chunk(self, finish: pb.GenerateChunk) -> dict:
        """The extra last chunk of stream_options.include_usage: no choices, the usage."""
        return {**self._chunk(None), "choices": [], "usage": usage(finish)}

    def _chunk(self, choice: Optional[dict]) -> dict:
        return {**self._head,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [] if choice is None else [choice]}


def error_body(message: str, type_: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
