"""OpenAI response bodies from the core's GenerateChunks: whole responses, stream chunks and
server-sent-event framing, for /v1/completions and /v1/chat/completions."""
from __future__ import annotations

import json
import time
from typing import Optional

from specserve.proto import generate_pb2 as pb
from specserve.server.fronts.openai.chat_outputs import ChatChoiceOutput, ChatDelta, ChatOutputMode
from specserve.server.text.logprobs import TokenTexts
from specserve.server.text.tool_calls import CallDelta, assemble_calls, new_call_id

# The core fails a request whose sequence ends otherwise (an error is an error response or
# event, never a finish_reason): only OpenAI's values reach a body ("tool_calls" from "stop").
_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One server-sent event: a `data:` line of compact JSON and a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def finish_reason(chunk: pb.GenerateChunk) -> Optional[str]:
    return _FINISH_REASONS.get(chunk.finish.reason) if chunk.HasField("finish") else None


class ResponseFormat:
    """The shapes of one request's responses; chat and completions differ only in the object
    names, in where the text goes (`message`/`delta` content or `text`) and in the logprobs
    layout. With n > 1 every choice is one sequence (GenerateChunk.index); usage counts the
    prompt once and the completions of every choice."""

    def __init__(self, rid: str, model: str, chat: bool, *, n: int = 1,
                 token_texts: Optional[TokenTexts] = None, echo_text: Optional[str] = None,
                 chat_mode: ChatOutputMode = ChatOutputMode()):
        self.chat = chat
        self.n = n
        # Chat: reasoning and tool calls parsed out of each choice's text (plain: text as is).
        self.chat_mode = chat_mode
        self._outputs = [ChatChoiceOutput(chat_mode) for _ in range(n)]
        # Set when the request asked for logprobs: a token's text is its own decoding (cached).
        self.token_texts = token_texts
        self.echo_text = echo_text   # completions with echo: the prompt, before the completion
        self._echoed: set[int] = set()  # choices whose stream has had the echo
        self._head = {"id": rid, "created": int(time.time()), "model": model}
        self._text_offsets = [0] * n   # completions logprobs: where the next token's text starts
        self._completion_tokens = [0] * n
        self._prompt_tokens = 0
        self._cached_tokens = [0] * n  # prompt tokens each choice took from the prefix cache

    def response(self, chunks: list[pb.GenerateChunk]) -> dict:
        """The whole response of a non-streaming request, from all its chunks."""
        by_index: list[list[pb.GenerateChunk]] = [[] for _ in range(self.n)]
        for chunk in chunks:
            by_index[chunk.index].append(chunk)
            self._count(chunk)
        choices = []
        for index, own in enumerate(by_index):
            text = "".join(c.text for c in own)
            choice: dict = {"index": index, "finish_reason": finish_reason(own[-1])}
            logprobs = self._logprobs(own) if self.token_texts is not None else None
            if self.chat:
                choice["message"] = self._message(index, text, choice)
            else:
                choice["text"] = (self.echo_text or "") + text
            choice["logprobs"] = logprobs
            choices.append(choice)
        return {**self._head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": choices, "usage": self._usage()}

    def first_chunks(self) -> list[dict]:
        """Chat streams open with the assistant's role (OpenAI's first delta) per choice."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}) for i in range(self.n)]

    def chunks(self, chunk: pb.GenerateChunk) -> list[dict]:
        """The stream chunks for a core chunk (none when it has nothing to say). Usually one;
        chat tool calls take one chunk per `delta.tool_calls` entry, as OpenAI sends them: a
        call's first (index, id, type, name, arguments "") and then its arguments' fragments.
        The first chunk has the logprobs, the last the finish_reason."""
        self._count(chunk)
        reason = finish_reason(chunk)
        logprobs = self._logprobs([chunk]) if self.token_texts is not None else None
        text = chunk.text
        if self.echo_text is not None and chunk.index not in self._echoed:
            self._echoed.add(chunk.index)
            text = self.echo_text + text
        deltas: list[dict] = [{"content": text} if text else {}]
        if self.chat and not self.chat_mode.plain:
            deltas = self._deltas(chunk.index, text, final=reason is not None)
            if reason == "stop" and self._outputs[chunk.index].num_calls:
                reason = "tool_calls"
        if deltas == [{}] and reason is None and not (logprobs and _has_tokens(logprobs)):
            return []
        choices = [{"index": chunk.index, "logprobs": logprobs if k == 0 else None,
                    "finish_reason": reason if k == len(deltas) - 1 else None}
                   for k in range(len(deltas))]
        for choice, delta in zip(choices, deltas):
            if self.chat:
                choice["delta"] = delta
            else:
                choice["text"] = text
        return [self._chunk(choice) for choice in choices]

    def usage_chunk(self) -> dict:
        """The extra last chunk of stream_options.include_usage: no choices, the usage."""
        return {**self._chunk(None), "choices": [], "usage": self._usage()}

    # --- internals -------------------------------------------------------------------------
    def _message(self, index: int, text: str, choice: dict) -> dict:
        """A whole chat choice's message; a stop that made tool calls is "tool_calls"."""
        if self.chat_mode.plain:
            return {"role": "assistant", "content": text}
        out = self._outputs[index]
        d = _merge(out.feed(text), out.finish())
        calls = assemble_calls(d.calls)   # the streamed deltas, whole: the same arguments text
        # Nothing but calls or reasoning: content is null, as OpenAI's (and vLLM's) API has it.
        message: dict = {"role": "assistant",
                         "content": d.content if d.content or not (calls or d.reasoning) else None}
        if self.chat_mode.reasoning_parser:
            message["reasoning_content"] = d.reasoning or None
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
            if choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        return message

    def _deltas(self, index: int, text: str, final: bool) -> list[dict]:
        """A core chunk's deltas: reasoning and content in the first, and one `tool_calls` entry
        in each (a call's opening, or its arguments' new text: fragments come merged)."""
        out = self._outputs[index]
        d = out.feed(text)
        if final:
            d = _merge(d, out.finish())
        delta: dict = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        entries = _call_entries(d.calls)
        if not entries:
            return [delta]
        return [{**delta, "tool_calls": [entries[0]]}] + [{"tool_calls": [e]} for e in entries[1:]]

    def _count(self, chunk: pb.GenerateChunk) -> None:
        if chunk.HasField("finish"):
            self._prompt_tokens = chunk.finish.usage.prompt_tokens
            self._completion_tokens[chunk.index] = chunk.finish.usage.completion_tokens
            self._cached_tokens[chunk.index] = chunk.finish.usage.cached_tokens


    def _usage(self) -> dict:
        completion = sum(self._completion_tokens)
        # The prompt counts once: its cached part is what every choice took from the cache.
        return {"prompt_tokens": self._prompt_tokens, "completion_tokens": completion,
                "total_tokens": self._prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": min(self._cached_tokens)}}

    def _logprobs(self, chunks: list[pb.GenerateChunk]) -> dict:
        """OpenAI's logprobs object for the tokens of these chunks (one choice's)."""
        if self.chat:
            return {"content": [_chat_logprob(self.token_texts(token_id), c.logprobs[i],
                                              c.top_logprobs[i] if c.top_logprobs else None)
                                for c in chunks for i, token_id in enumerate(c.token_ids)]}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        index = chunks[0].index if chunks else 0
        for chunk in chunks:
            if self.echo_text is not None:
                for p in chunk.prompt_logprobs:
                    tokens.append(p.text)
                    token_logprobs.append(p.logprob if p.HasField("logprob") else None)
                    top_logprobs.append({t.text: t.logprob for t in p.top}
                                        if p.HasField("logprob") else None)
                    offsets.append(self._advance(index, p.text))
            for i, token_id in enumerate(chunk.token_ids):
                text = self.token_texts(token_id)
                tokens.append(text)
                token_logprobs.append(chunk.logprobs[i])
                top_logprobs.append({t.text: t.logprob for t in chunk.top_logprobs[i].candidates}
                                    if chunk.top_logprobs else {})
                offsets.append(self._advance(index, text))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _advance(self, index: int, text: str) -> int:
        offset = self._text_offsets[index]
        self._text_offsets[index] += len(text)
        return offset

    def _chunk(self, choice: Optional[dict]) -> dict:
        return {**self._head,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [] if choice is None else [choice]}


def _call_entries(calls: list[CallDelta]) -> list[dict]:
    """`delta.tool_calls` entries: a call's opening (its id made here, sent once), and its
    arguments' fragments, those in a row merged."""
    entries: list[dict] = []
    for c in calls:
        if c.name is not None:
            entries.append({"index": c.index, "id": new_call_id(), "type": "function",
                            "function": {"name": c.name, "arguments": ""}})
        elif not c.arguments:
            continue
        elif entries and entries[-1]["index"] == c.index and "id" not in entries[-1]:
            entries[-1]["function"]["arguments"] += c.arguments
        else:
            entries.append({"index": c.index, "function": {"arguments": c.arguments}})
    return entries


def _merge(a: ChatDelta, b: ChatDelta) -> ChatDelta:
    return ChatDelta(a.reasoning + b.reasoning, a.content + b.content, a.calls + b.calls)


def _has_tokens(logprobs: dict) -> bool:
    return bool(logprobs.get("content") or logprobs.get("tokens"))


def _chat_logprob(text: str, logprob: float, top: Optional[pb.TopLogprobs]) -> dict:
    candidates = list(top.candidates) if top is not None else []
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": c.text, "logprob": c.logprob, "bytes": list(c.text.encode())}
                             for c in candidates]}


def error_body(message: str, type_: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
