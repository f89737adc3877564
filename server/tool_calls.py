"""Tool calls in a chat model's output (`--tool-call-parser`), and the grammars that force them.

Two formats, chosen per model:
  "hermes"      (Hermes, Qwen 2.5/3): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>,
                one block per call, possibly after some text.
  "llama3_json" (Llama 3.1-3.3): the whole output is {"name": ..., "parameters": {...}} (an
                optional <|python_tag|> first; several calls separated by ";").
The default comes from the chat template: one that mentions <tool_call> is hermes, one that
mentions <|python_tag|> or "parameters" is llama3_json, else hermes.

`tool_choice` "required" and a named function do not go through a format: the output is
generated under a JSON-schema grammar (a list of {"name", "parameters"} objects, or the named
function's parameters) and read as JSON, as vLLM does. Streams hold a call back until it is
complete and send it as one delta (name and the whole arguments).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, NamedTuple, Optional

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolCall(NamedTuple):
    name: str
    arguments: str   # JSON text

    def to_openai(self, index: Optional[int] = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ParsedOutput(NamedTuple):
    content: str
    calls: list[ToolCall]


def check_tool_call_parser(name: Optional[str]) -> None:
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser: must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {name!r}")


def default_tool_call_parser(chat_template: Optional[str]) -> str:
    template = chat_template or ""
    if HERMES_START in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def _call_from_json(obj: Any, arguments_key: str) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, parser: str) -> ParsedOutput:
    """The calls in a whole output and the text around them; an output that is not a
    well-formed call stays content (the model answered in text)."""
    if parser == "hermes":
        content, calls, rest = [], [], text
        while True:
            start = rest.find(HERMES_START)
            end = rest.find(HERMES_END, start + len(HERMES_START)) if start >= 0 else -1
            if end < 0:
                content.append(rest)
                break
            try:
                call = _call_from_json(json.loads(rest[start + len(HERMES_START):end]), "arguments")
            except ValueError:
                call = None
            if call is None:
                content.append(rest[:end + len(HERMES_END)])
            else:
                content.append(rest[:start])
                calls.append(call)
            rest = rest[end + len(HERMES_END):]
        return ParsedOutput("".join(content).strip() if calls else text, calls)
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    calls = []
    for part in body.split(";") if body.startswith("{") else []:
        try:
            call = _call_from_json(json.loads(part), "parameters")
        except ValueError:
            call = None
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
    return ParsedOutput("" if calls else text, calls)


class ToolCallStream:
    """One choice's streamed text: content passes through until a tool call may have begun,
    then is held; each complete call comes out once."""

    def __init__(self, parser: str):
        self.parser = parser
        self._text = ""          # everything seen
        self._sent_content = 0   # characters of _text already sent as content
        self._sent_calls = 0
        self._decided_llama: Optional[bool] = None  # llama3_json: the output is a call

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._text += text
        if self.parser == "llama3_json":
            return self._feed_llama()
        parsed = parse_tool_calls(self._text, "hermes")
        calls = parsed.calls[self._sent_calls:]
        self._sent_calls = len(parsed.calls)
        # Content is sent up to the first unfinished call block (or a possible start of one).
        unfinished = self._text.rfind(HERMES_START)
        if unfinished >= 0 and self._text.find(HERMES_END, unfinished) >= 0:
            unfinished = -1
        safe = len(self._text) if unfinished < 0 else unfinished
        safe -= _partial_suffix(self._text[:safe], HERMES_START)
        content = ""
        if not parsed.calls and safe > self._sent_content:
            content = self._text[self._sent_content:safe]
            self._sent_content = safe
        return content, calls

    def _feed_llama(self) -> tuple[str, list[ToolCall]]:
        if self._decided_llama is None:
            stripped = self._text.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return "", []
            self._decided_llama = stripped.startswith("{") or stripped.startswith(PYTHON_TAG)
        if self._decided_llama:
            return "", []   # the call is parsed when the output ends
        content = self._text[self._sent_content:]
        self._sent_content = len(self._text)
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left once the output ended: held text, and calls not sent yet."""
        parsed = parse_tool_calls(self._text, self.parser)
        calls = parsed.calls[self._sent_calls:]
        self._sent_calls = len(parsed.calls)
        content = "" if parsed.calls else self._text[self._sent_content:]
        self._sent_content = len(self._text)
        return content, calls


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# --- forced calls: tool_choice "required" or a named function -----------------------------------
def required_calls_schema(tools: list[dict]) -> dict:
    """One or more calls of the given functions, as a JSON list."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
         "properties": {"name": {"type": "string", "enum": [t["name"]]},
                        "parameters": t.get("parameters") or {"type": "object"}}}
        for t in tools]}}


def parse_forced_calls(text: str, named: Optional[str]) -> list[ToolCall]:
    """The calls of an output generated under a forced-call grammar (empty if it was cut)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if named is not None:
        return [ToolCall(named, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
            for c in value if isinstance(c, dict) and "name" in c]
