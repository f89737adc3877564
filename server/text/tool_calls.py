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
    well-formed call stays content (the model answered in text). The same parse as a stream's."""
    stream = ToolCallStream(parser)
    content, calls = stream.feed(text)
    more, late = stream.finish()
    return ParsedOutput(content + more, calls + late)


def _parse_llama(text: str) -> list[ToolCall]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    calls = []
    # Calls are separated by ";" (one inside a string value would split a call: not parsed).
    for part in body.split(";") if body.startswith("{") else []:
        try:
            call = _call_from_json(json.loads(part), "parameters")
        except ValueError:
            call = None
        if call is None:
            return []
        calls.append(call)
    return calls


class ToolCallStream:
    """One choice's text as it arrives: content outside calls passes through (held back while
    it may be the start of one), and each complete call comes out once. A block that is not a
    well-formed call stays content."""

    def __init__(self, parser: str):
        self.parser = parser
        self._text = ""          # everything seen
        self._pos = 0            # hermes: where the unparsed text starts
        self._in_call = False    # hermes: inside a <tool_call> block
        self._is_call: Optional[bool] = None  # llama3_json: the whole output is a call

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._text += text
        return self._feed_llama() if self.parser == "llama3_json" else self._feed_hermes()

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        while True:
            rest = self._text[self._pos:]
            if self._in_call:
                end = rest.find(HERMES_END)
                if end < 0:
                    break
                self._pos += end + len(HERMES_END)
                self._in_call = False
                try:
                    call = _call_from_json(json.loads(rest[:end]), "arguments")
                except ValueError:
                    call = None
                if call is None:
                    content += HERMES_START + rest[:end + len(HERMES_END)]
                else:
                    calls.append(call)
                continue
            start = rest.find(HERMES_START)
            if start >= 0:
                content += rest[:start]
                self._pos += start + len(HERMES_START)
                self._in_call = True
                continue
            safe = len(rest) - _partial_suffix(rest, HERMES_START)
            content += rest[:safe]
            self._pos += safe
            break
        return content, calls

    def _feed_llama(self) -> tuple[str, list[ToolCall]]:
        if self._is_call is None:
            stripped = self._text.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return "", []
            self._is_call = stripped.startswith("{") or stripped.startswith(PYTHON_TAG)
        if self._is_call:
            return "", []   # parsed when the output ends
        content = self._text[self._pos:]
        self._pos = len(self._text)
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left once the output ended: held text, and calls known only at the end."""
        rest = self._text[self._pos:]
        self._pos = len(self._text)
        if self.parser == "llama3_json":
            if not self._is_call:
                return rest, []
            calls = _parse_llama(self._text)
            return ("", calls) if calls else (self._text, [])
        return (HERMES_START + rest if self._in_call else rest), []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# --- forced calls: tool_choice "required" or a named function -----------------------------------
def required_calls_schema(tools: list[dict], parallel: bool = True) -> dict:
    """One or more calls of the given functions, as a JSON list (one with parallel False)."""
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": [
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
