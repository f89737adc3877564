"""Reasoning and tool-call parsing of chat outputs: a whole output and the same output streamed
in any two pieces (or character by character) give the same reasoning, content and calls."""
from __future__ import annotations

import pytest

from specserve.server.fronts.openai.chat_outputs import ChatChoiceOutput, ChatOutputMode
from specserve.server.text.reasoning import ReasoningSplitter
from specserve.server.text.tool_calls import ToolCall, default_tool_call_parser, parse_tool_calls


def _split(parser, pieces):
    s = ReasoningSplitter(parser)
    reasoning = content = ""
    for piece in pieces:
        d = s.feed(piece)
        reasoning, content = reasoning + d.reasoning, content + d.content
    d = s.finish()
    return reasoning + d.reasoning, content + d.content


@pytest.mark.parametrize("parser, text, want", [
    ("deepseek-r1", "<think>abc</think>hi", ("abc", "hi")),
    ("deepseek-r1", "abc</think>hi", ("abc", "hi")),        # the template opened the block
    ("deepseek-r1", "still thinking </thi", ("still thinking </thi", "")),
    ("qwen3", "<think>abc</think>hi", ("abc", "hi")),
    ("qwen3", "no thinking <think>", ("", "no thinking <think>")),
    ("qwen3", "<thi", ("", "<thi")),
])
def test_reasoning_split_whole_and_streamed(parser, text, want):
    assert _split(parser, [text]) == want
    assert _split(parser, list(text)) == want
    for cut in range(len(text) + 1):
        assert _split(parser, [text[:cut], text[cut:]]) == want


HERMES = ('Checking.<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>{"name": "t", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", HERMES, "Checking.\n", [ToolCall("w", '{"city": "Oslo"}'), ToolCall("t", "{}")]),
    ("hermes", "a <tool_call>not json</tool_call>", "a <tool_call>not json</tool_call>", []),
    ("hermes", "cut <tool_call>{\"name\"", "cut <tool_call>{\"name\"", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")]),
    ("llama3_json", "plain {text}", "plain {text}", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
])
def test_tool_calls_whole_and_streamed(parser, text, content, calls):
    assert parse_tool_calls(text, parser) == (content, calls)
    for pieces in ([text], list(text), [text[:7], text[7:]]):
        out = ChatChoiceOutput(ChatOutputMode(tool_call_parser=parser))
        got_content, got_calls = "", []
        for piece in pieces:
            d = out.feed(piece)
            got_content, got_calls = got_content + d.content, got_calls + d.calls
        d = out.finish()
        assert (got_content + d.content, got_calls + d.calls) == (content, calls)


def test_reasoning_then_tool_calls():
    out = ChatChoiceOutput(ChatOutputMode(reasoning_parser="qwen3", tool_call_parser="hermes"))
    text = '<think>need weather</think><tool_call>{"name": "w", "arguments": {}}</tool_call>'
    deltas = [out.feed(c) for c in text] + [out.finish()]
    assert "".join(d.reasoning for d in deltas) == "need weather"
    assert "".join(d.content for d in deltas) == ""
    assert [c for d in deltas for c in d.calls] == [ToolCall("w", "{}")]


def test_forced_calls_are_read_at_the_end():
    out = ChatChoiceOutput(ChatOutputMode(forced_calls=True, forced_name="w"))
    assert out.feed('{"city": ') == ("", "", [])   # held until the end
    assert out.finish() == ("", '{"city": ', [])    # cut short: no call
    out = ChatChoiceOutput(ChatOutputMode(forced_calls=True, forced_name="w"))
    out.feed('{"city": "Oslo"}')
    assert out.finish() == ("", "", [ToolCall("w", '{"city": "Oslo"}')])
    out = ChatChoiceOutput(ChatOutputMode(forced_calls=True))
    out.feed('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')
    assert out.finish().calls == [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]
    out = ChatChoiceOutput(ChatOutputMode(forced_calls=True))
    out.feed('[{"name": "a", "para')   # cut by max_tokens: no call, the text is the content
    assert out.finish() == ("", '[{"name": "a", "para', [])


def test_default_parser_from_the_chat_template():
    assert default_tool_call_parser("... <tool_call> ...") == "hermes"
    assert default_tool_call_parser("{{ '<|python_tag|>' }} ...") == "llama3_json"
    assert default_tool_call_parser(None) == "hermes"
