"""One chat choice's output as OpenAI shapes it: reasoning_content, content and tool_calls,
from the text the core streams (whole or in pieces). Composes the reasoning splitter and the
tool-call parsers (server/text/reasoning.py, server/text/tool_calls.py); what a request asks for is its
ChatOutputMode. Tool calls come out incrementally (CallDelta: a call's name first, then fragments
of its arguments text), streamed or not: a whole output is the same deltas, assembled."""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

from specserve.server.text.reasoning import ReasoningSplitter
from specserve.server.text.tool_calls import CallDelta, ForcedCallStream, ToolCallStream


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
    calls: list[CallDelta]   # pieces of calls (tool_calls.assemble_calls makes them whole)


class ChatChoiceOutput:
    def __init__(self, mode: ChatOutputMode):
        self.mode = mode
        self._reasoning = ReasoningSplitter(mode.reasoning_parser) if mode.reasoning_parser else None
        self._tools: Optional[Union[ToolCallStream, ForcedCallStream]] = None
        if mode.forced_calls:
            self._tools = ForcedCallStream(mode.forced_name)
        elif mode.tool_call_parser:
            self._tools = ToolCallStream(mode.tool_call_parser)

    @property
    def num_calls(self) -> int:
        """Calls begun so far (named)."""
        return self._tools.num_calls if self._tools is not None else 0

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
        # Forced calls: the output is the calls (content only if none came: the text, at the end).
        calls: list[CallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if final:
                more, late = self._tools.finish()
                content, calls = content + more, calls + late
        return ChatDelta(reasoning, content, calls)
