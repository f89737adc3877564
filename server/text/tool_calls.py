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
function's parameters) and read as the calls (ForcedCallStream).

Calls stream as they are generated, as OpenAI's API (and vLLM's) sends them. Each call object is
followed by a small incremental scanner (_CallScanner: string, escape and nesting state and the
object's top-level members; not a validating parser). Once its "name" string is complete the
call's first CallDelta carries the name; later ones carry the text of its arguments value as it
arrives, up to the last character known to belong to it: whitespace after the value, the outer
object's "}", a "<" that may begin </tool_call>, a scalar's end are held until known. The
arguments are the model's own text of that value, never re-serialised: an object (or any other
non-string value) exactly as written; a string value (some models write the arguments JSON as a
string) decoded; "{}" for an object that closes without an arguments member. A whole output is
parsed by the same streams, fed the whole text (parse_tool_calls, parse_forced_calls), so the
fragments of a streamed call concatenate to the non-streamed arguments, whatever pieces the text
came in. The first "name" and the first "arguments" (or "parameters") member are the ones read.

Once named, a call stands. If the output then ends ("length") or the object breaks off (a
</tool_call>, or a character that cannot come there), its arguments are the text sent so far
(maybe not valid JSON, maybe empty), in streamed and whole responses alike. Text before a call's
name is known is held back; if it turns out not to be a call (no "{", an object without a
"name" string, a block or output that ends first) it comes out as content, as written. Text
between a hermes call's object and its </tool_call> is dropped; llama3_json text after the calls
that does not begin another call is content. Forced outputs have content only if no call came
(the text, at the end).
"""
from __future__ import annotations

import re
import uuid
from typing import Iterable, NamedTuple, Optional

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WS = " \t\n\r"
_ARGUMENT_KEYS = ("arguments", "parameters")
_SCALAR = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-.")


class ToolCall(NamedTuple):
    name: str
    arguments: str   # JSON text

    def to_openai(self, index: Optional[int] = None) -> dict:
        call = {"id": new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallDelta(NamedTuple):
    """A piece of one streamed call: its first has the name (and no arguments), the later ones
    fragments of its arguments text."""
    index: int            # the call's place among the output's calls
    name: Optional[str]   # set on the call's first delta only
    arguments: str = ""


def assemble_calls(deltas: Iterable[CallDelta]) -> list[ToolCall]:
    """The whole calls from their deltas."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    return [ToolCall(name, args) for _, (name, args) in sorted(calls.items())]


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


def parse_tool_calls(text: str, parser: str) -> ParsedOutput:
    """The calls in a whole output and the text around them; an output that is not a call stays
    content (the model answered in text). The stream's own parse, fed the whole text."""
    stream = ToolCallStream(parser)
    content, deltas = stream.feed(text)
    more, late = stream.finish()
    return ParsedOutput(content + more, assemble_calls(deltas + late))


def parse_forced_calls(text: str, named: Optional[str]) -> list[ToolCall]:
    """The calls of an output generated under a forced-call grammar (a cut one: the calls begun)."""
    stream = ForcedCallStream(named)
    _, deltas = stream.feed(text)
    _, late = stream.finish()
    return assemble_calls(deltas + late)


# --- incremental JSON scanning --------------------------------------------------------------------
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ESCAPE = re.compile(r'\\(u[0-9a-fA-F]{4}|["\\/bfnrt])')


def _unescape(body: str) -> str:
    """A JSON string's body decoded escape by escape (an invalid escape stays as written), so that
    decoding it in pieces cut between escapes gives the same text; surrogate halves stay apart."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1)[1:], 16)) if m.group(1)[0] == "u"
                       else _ESCAPES[m.group(1)], body)


def _join_surrogates(text: str) -> str:
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


class _Value:
    """The text of one JSON value as it arrives, a character at a time from its first. Strings,
    escapes and nesting are followed, not the grammar: the value ends with a container's closing
    bracket, a string's closing quote, or before the first character that cannot be in a scalar."""

    def __init__(self):
        self._raw = ""
        self._chars: list[str] = []   # taken since raw was last asked for
        self._len = 0
        self.kind = ""          # "string", "container" or "scalar", from the first character
        self.complete = False   # a string or container closed (a scalar only ends before the next)
        self.in_string = False
        self.safe = 0           # strings: raw[:safe] does not end inside an escape
        self._depth = 0
        self._escape = False
        self._hex = 0           # \uXXXX digits still to come

    def push(self, c: str) -> bool:
        """Take the next character; False when the value ended before it."""
        if self.complete:
            return False
        if not self.kind:
            if c not in _SCALAR and c not in '"{[':
                return False
            self.kind = "string" if c == '"' else "container" if c in "{[" else "scalar"
        self._chars.append(c)
        if self.in_string:
            self._len += 1
            if self._escape:
                self._escape = False
                self._hex = 4 if c == "u" else 0
            elif self._hex:
                self._hex -= 1
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self.in_string = False
                self.complete = self.kind == "string"
                return True
            if not (self._escape or self._hex):
                self.safe = self._len
            return True
        if self.kind == "scalar" and c not in _SCALAR:
            self._chars.pop()
            return False
        self._len += 1
        if self.kind == "scalar":
            return True
        if c == '"':
            self.in_string = True
            self.safe = self._len
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            self.complete = self._depth == 0
        return True

    @property
    def raw(self) -> str:
        """The value's text so far."""
        if self._chars:
            self._raw += "".join(self._chars)
            self._chars.clear()
        return self._raw

    def string(self) -> str:
        """A complete string value, decoded."""
        return _join_surrogates(_unescape(self.raw[1:-1]))


class _Arguments:
    """A call's arguments text as it becomes known (grows only): the raw text of its value, or,
    with `decode` and a string value, the string decoded (a trailing surrogate half held back)."""

    def __init__(self, value: _Value, decode: bool = True):
        self.value = value
        self.decode = decode
        self.text = ""
        self._pos = 1        # raw position decoded up to (after the opening quote)
        self._held = ""      # a high surrogate whose low half may follow

    def known(self) -> str:
        v = self.value
        if v.kind != "string" or not self.decode:
            return v.raw
        piece = self._held + _unescape(v.raw[self._pos:v.safe])
        self._pos = max(self._pos, v.safe)
        piece = _join_surrogates(piece)
        self._held = ""
        if piece and "\ud800" <= piece[-1] <= "\udbff" and not v.complete:
            piece, self._held = piece[:-1], piece[-1]
        self.text += piece
        return self.text


class _CallScanner:
    """One call object, {"name": ..., "arguments": ...} ("parameters" also names the arguments),
    followed as its text arrives from where its "{" is expected: the name once its string is
    complete, and the arguments value (`args`) as far as it is known. `ended`: nothing more
    belongs to the object (`closed`: its "}" came; else it broke off at `i`: a character that
    cannot come there, or `end_tag` outside a string)."""

    def __init__(self, end_tag: Optional[str] = None):
        self.end_tag = end_tag
        self.text = ""     # the object's text so far (and whatever follows it)
        self.i = 0         # where scanning stopped (waiting for more, or the object's end)
        self.name: Optional[str] = None
        self.args: Optional[_Arguments] = None
        self.ended = False
        self.closed = False
        self._state = "open"   # open, first, key, colon, value, after, next
        self._key_start = 0
        self._key_escape = False
        self._key = ""
        self._value: Optional[_Value] = None

    def feed(self, text: str) -> None:
        self.text += text
        t, tag = self.text, self.end_tag
        while not self.ended and self.i < len(t):
            c, value = t[self.i], self._value
            if c == "<" and tag and self._state != "key" and not (value and value.in_string):
                ahead = t[self.i:self.i + len(tag)]
                if ahead == tag:
                    self.ended = True
                    return
                if tag.startswith(ahead):
                    return   # maybe the tag: wait for more
            if value is not None:
                if not value.push(c):
                    self._end_value()   # c comes after it
                    continue
                self.i += 1
                if value.complete:
                    self._end_value()
                continue
            state = self._state
            if state == "key":
                self.i += 1
                if self._key_escape:
                    self._key_escape = False
                elif c == "\\":
                    self._key_escape = True
                elif c == '"':
                    self._key = _unescape(t[self._key_start + 1:self.i - 1])
                    self._state = "colon"
                continue
            if c in _WS:
                self.i += 1
            elif state == "open" and c == "{":
                self.i += 1
                self._state = "first"
            elif state in ("first", "next") and c == '"':
                self._key_start = self.i
                self.i += 1
                self._state = "key"
            elif state == "colon" and c == ":":
                self.i += 1
                self._state = "value"
            elif state == "value":
                self._value = _Value()
                if self._key in _ARGUMENT_KEYS and self.args is None:
                    self.args = _Arguments(self._value)
            elif state == "after" and c == ",":
                self.i += 1
                self._state = "next"
            elif state in ("first", "after") and c == "}":
                self.i += 1
                self.ended = self.closed = True
            else:
                self.ended = True   # not JSON: the object broke off before c

    def _end_value(self) -> None:
        value, self._value, self._state = self._value, None, "after"
        if self._key == "name" and self.name is None and value.kind == "string" and value.complete:
            self.name = value.string()


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# --- streams ---------------------------------------------------------------------------------------
class _CallSender:
    """Sends the calls of one output as CallDeltas: a call's name once it is known, then each new
    piece of its arguments text; "{}" for a call whose object closed without an arguments member."""

    def __init__(self):
        self.num_calls = 0
        self._sent: Optional[int] = None   # the current call: arguments characters sent (None: not named)

    def send(self, name: Optional[str], args: Optional[_Arguments], out: list[CallDelta],
             ending: bool = False, closed: bool = False) -> None:
        if name is None:
            return
        if self._sent is None:
            out.append(CallDelta(self.num_calls, name))
            self.num_calls += 1
            self._sent = 0
        text = args.known() if args is not None else "{}" if closed else ""
        if len(text) > self._sent:
            out.append(CallDelta(self.num_calls - 1, None, text[self._sent:]))
            self._sent = len(text)
        if ending:
            self._sent = None

    def send_scanner(self, scanner: _CallScanner, out: list[CallDelta], ending: bool = False) -> None:
        self.send(scanner.name, scanner.args, out, ending, scanner.closed)


class _CallStream:
    """What both streams keep: the text so far, the calls sent, the call being read. `feed`
    appends the text and lets the subclass's `_read` turn the unread part into content and
    CallDeltas."""

    def __init__(self):
        self._text = ""          # everything seen
        self._pos = 0            # where the unread text starts
        self._calls = _CallSender()
        self._call: Optional[_CallScanner] = None   # the call object being read
        self._call_start = 0     # where its text starts in _text

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._text += text
        out: list[CallDelta] = []
        return self._read(out), out

    def _read(self, out: list[CallDelta]) -> str:
        raise NotImplementedError


class ToolCallStream(_CallStream):
    """One choice's text as it arrives, in a tool-call format: content outside calls passes
    through (held back while it may be the start of one), and calls come out as CallDeltas as
    their text arrives (see the module's docstring)."""

    def __init__(self, parser: str):
        super().__init__()
        self.parser = parser
        self._held_from = 0      # llama3_json: where text held back while the call is unnamed starts
        self._search = 0         # hermes: where to look for the end tag of a call's block
        self._mode = "start"     # llama3_json: start, call, between, content

    def _read(self, out: list[CallDelta]) -> str:
        return self._feed_llama(out) if self.parser == "llama3_json" else self._feed_hermes(out)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left once the output ended: held text, or the end of a cut call."""
        out: list[CallDelta] = []
        call, rest = self._call, self._text[self._pos:]
        self._pos = len(self._text)
        if call is not None and call.name is not None:
            if not call.ended:   # cut: the call stands as sent
                self._calls.send_scanner(call, out, ending=True)
            return "", out
        if call is not None:   # an unnamed call: its text is content
            return (HERMES_START + self._text[self._call_start:] if self.parser == "hermes"
                    else self._text[self._held_from:]), out
        if self.parser == "llama3_json" and self._mode == "start":
            return self._text, out
        return rest, out

    def _read_call(self, out: list[CallDelta]) -> bool:
        """Feed the current call the unread text; True once its object is over."""
        call = self._call
        call.feed(self._text[self._pos:])
        self._pos = len(self._text)
        self._calls.send_scanner(call, out, ending=call.ended)
        return call.ended

    def _feed_hermes(self, out: list[CallDelta]) -> str:
        content = ""
        while True:
            if self._call is None:   # in content
                rest = self._text[self._pos:]
                start = rest.find(HERMES_START)
                if start < 0:
                    safe = len(rest) - _partial_suffix(rest, HERMES_START)
                    self._pos += safe
                    return content + rest[:safe]
                content += rest[:start]
                self._pos += start + len(HERMES_START)
                self._call, self._call_start, self._search = _CallScanner(HERMES_END), self._pos, -1
            call = self._call
            if self._search < 0:
                if not self._read_call(out):
                    return content
                self._search = self._call_start + call.i
            # The object is over: its block ends with the end tag (what comes before it is dropped).
            end = self._text.find(HERMES_END, self._search)
            if end < 0:
                self._search = max(self._search, len(self._text) - len(HERMES_END) + 1)
                self._pos = len(self._text)
                return content
            if call.name is None:   # not a call: the block is content, as written
                content += HERMES_START + self._text[self._call_start:end + len(HERMES_END)]
            self._pos = end + len(HERMES_END)
            self._call = None

    def _feed_llama(self, out: list[CallDelta]) -> str:
        content = ""
        while True:
            text = self._text
            if self._mode == "start":   # the whole output is calls, or content
                body = text.lstrip()
                if body.startswith(PYTHON_TAG):
                    body = body[len(PYTHON_TAG):].lstrip()
                elif PYTHON_TAG.startswith(body):
                    return ""   # nothing yet, or maybe the tag
                if not body:
                    return ""
                if body[0] != "{":
                    self._mode, self._pos = "content", 0
                    continue
                self._mode, self._held_from = "call", 0
                self._start_call(len(text) - len(body))
            if self._mode == "call":
                if not self._read_call(out):
                    return content
                call, self._call = self._call, None
                if call.name is None:   # not a call: the text held for it is content
                    self._mode, self._pos = "content", self._held_from
                    continue
                self._mode, self._pos = "between", self._call_start + call.i
            if self._mode == "between":   # after a call: ";" and another, or content
                rest = text[self._pos:]
                body = rest.lstrip(_WS + ";")
                if not body:
                    self._pos = len(text)
                    return content
                self._pos += len(rest) - len(body)
                if body[0] == "{":
                    self._mode, self._held_from = "call", self._pos
                    self._start_call(self._pos)
                    continue
                self._mode = "content"
            content += text[self._pos:]
            self._pos = len(text)
            return content

    def _start_call(self, at: int) -> None:
        self._call, self._call_start, self._pos = _CallScanner(), at, at


class ForcedCallStream(_CallStream):
    """The output of a forced-call grammar as it arrives: with `named`, the output is that
    function's arguments (the call is named at its first character); else a JSON list of
    {"name", "parameters"} calls. Content only if no call came: the text, at the end."""

    def __init__(self, named: Optional[str]):
        super().__init__()
        self.named = named
        self._value: Optional[_Value] = None   # named: the arguments
        self._state = "start"   # list: start, list, call, done

    def _read(self, out: list[CallDelta]) -> str:
        if self.named is not None:
            self._feed_named(out)
        else:
            self._feed_list(out)
        return ""

    def finish(self) -> tuple[str, list[CallDelta]]:
        out: list[CallDelta] = []
        if self._call is not None:
            self._calls.send_scanner(self._call, out, ending=True)
        return ("" if self.num_calls else self._text), out

    def _feed_named(self, out: list[CallDelta]) -> None:
        if self._value is None:
            body = self._text.lstrip()
            if not body:
                return
            self._value, self._pos = _Value(), len(self._text) - len(body)
            self._args = _Arguments(self._value, decode=False)
        while self._pos < len(self._text) and self._value.push(self._text[self._pos]):
            self._pos += 1
        self._pos = len(self._text)   # what follows the value (nothing, under the grammar) is dropped
        self._calls.send(self.named, self._args, out)

    def _feed_list(self, out: list[CallDelta]) -> None:
        text = self._text
        while self._pos < len(text) and self._state != "done":
            if self._state == "call":
                call = self._call
                call.feed(text[self._pos:])
                self._pos = len(text)
                self._calls.send_scanner(call, out, ending=call.ended)
                if not call.ended:
                    return
                self._call, self._state, self._pos = None, "list", self._call_start + call.i
                continue
            c = text[self._pos]
            if c in _WS or (c == "," and self._state == "list"):
                self._pos += 1
            elif c == "[" and self._state == "start":
                self._pos += 1
                self._state = "list"
            elif c == "{" and self._state == "list":
                self._call, self._call_start, self._state = _CallScanner(), self._pos, "call"
            else:
                self._state = "done"   # "]", or not a list of calls


# --- forced calls: tool_choice "required" or a named function -----------------------------------
def required_calls_schema(tools: list[dict], parallel: bool = True) -> dict:
    """One or more calls of the given functions, as a JSON list (one with parallel False).

    Each function's parameters schema moves to the root's `$defs` (as `tool<i>`) and its
    call's `parameters` refers to it: a schema's own references (`#/$defs/...`, `#`) are
    relative to its root, so they are rewritten to point inside `#/$defs/tool<i>`."""
    defs = {f"tool{i}": _rebased(t.get("parameters") or {"type": "object"}, f"#/$defs/tool{i}")
            for i, t in enumerate(tools)}
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
         "properties": {"name": {"type": "string", "enum": [t["name"]]},
                        "parameters": {"$ref": f"#/$defs/tool{i}"}}}
        for i, t in enumerate(tools)]}, "$defs": defs}


def _rebased(schema, root: str):
    """The schema with each local `$ref` ("#...") made relative to `root` instead of "#"."""
    if isinstance(schema, dict):
        return {key: (root + value[1:] if key == "$ref" and isinstance(value, str)
                      and value.startswith("#") else _rebased(value, root))
                for key, value in schema.items()}
    if isinstance(schema, list):
        return [_rebased(value, root) for value in schema]
    return schema
