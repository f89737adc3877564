"""One chat choice's output as OpenAI shapes it: reasoning_content, content and tool_calls,
from the text the core streams (whole or in pieces). Composes the reasoning splitter and the
tool-call parsers (server/text/reasoning.py, server/text/tool_calls.py); what a request asks for is its
ChatOutputMode."""
from __future__ import annotations

from typing import NamedTuple, Optional

from specserve.server.text.reasoning import ReasoningSplitter
from specserve.server.text.tool_calls import ToolCall, ToolCallStream, parse_forced_calls


class ChatOutputMode(NamedTuple):
    reasoning_parser: Optional[str] = None   # split <think> ... </think> off
    tool_call_parser: Optional[str] = None   # tools with tool_choice auto: parse calls in this format
    forced_calls: bool = False               # tool_choice required or named: the output is the calls' JSON
    forced_name: Optional[str] = None        # the named function (its arguments are the output)

    @property
    def plain(self) -> bool:
        return self == ChatOutputMode()


class ChatDelta(NamedTuple):
    reasoning: str
    content: str
    calls: list[ToolCall]


class ChatChoiceOutput:
    def __init__(self, mode: ChatOutputMode):
        self.mode = mode
        self._reasoning = ReasoningSplitter(mode.reasoning_parser) if mode.reasoning_parser else None
        self._tools = ToolCallStream(mode.tool_call_parser) \
            if mode.tool_call_parser and not mode.forced_calls else None
        self._forced_text = ""
        self.num_calls = 0

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = self._split(text, final=False)
        return self._content(reasoning, content, final=False)

    def finish(self) -> ChatDelta:
        """What the end of the output releases (held text, calls known only at the end)."""
        reasoning, content = self._split("", final=True)
        return self._content(reasoning, content, final=True)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self._reasoning is None:
            return "", text
        delta = self._reasoning.finish() if final else self._reasoning.feed(text)
        if final:  # text fed with the end is split before the held part
            return delta.reasoning, delta.content
        return delta

    def _content(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        calls: list[ToolCall] = []
        if self.mode.forced_calls:
            self._forced_text += content
            content = ""
            if final:
                calls = parse_forced_calls(self._forced_text, self.mode.forced_name)
                content = "" if calls else self._forced_text   # cut short ("length"): the text
        elif self._tools is not None:
            content, calls = self._tools.feed(content)
            if final:
                more, late = self._tools.finish()
                content, calls = content + more, calls + late
        self.num_calls += len(calls)
        return ChatDelta(reasoning, content, calls)
