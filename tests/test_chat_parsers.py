"""Reasoning and tool-call parsing of chat outputs: a whole output and the same output streamed
in any pieces (every two-piece cut, character by character, random token-like pieces) give the
same reasoning, content and calls; streamed calls are named once, then their arguments come in
fragments that concatenate to the whole output's arguments (the model's text of the value)."""
from __future__ import annotations

import json
import random
from typing import Optional

import pytest

from specserve.server.fronts.openai.chat_outputs import ChatChoiceOutput, ChatOutputMode
from specserve.server.text.reasoning import ReasoningSplitter
from specserve.server.text.tool_calls import (HERMES_END, HERMES_START, PYTHON_TAG, CallDelta, ToolCall,
                                         assemble_calls, default_tool_call_parser,
                                         parse_forced_calls, parse_tool_calls)


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


def _stream(mode: ChatOutputMode, pieces) -> tuple[str, str, list[CallDelta]]:
    """(reasoning, content, call deltas) of an output fed in these pieces, checking the deltas'
    shape: calls numbered in order, each named once in its first delta (no arguments there),
    then only fragments of its arguments; one call at a time."""
    out = ChatChoiceOutput(mode)
    deltas = [out.feed(piece) for piece in pieces] + [out.finish()]
    calls = [c for d in deltas for c in d.calls]
    named = [c.index for c in calls if c.name is not None]
    assert named == list(range(len(named)))
    for k, c in enumerate(calls):
        if c.name is not None:
            assert c.arguments == ""
        else:
            assert c.arguments and named and c.index == max(i for i in named if any(
                d.name is not None and d.index == i for d in calls[:k]))
    assert out.num_calls == len(named)
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), calls)


def _whole(mode: ChatOutputMode, text: str) -> tuple[str, list[ToolCall]]:
    _, content, calls = _stream(mode, [text])
    return content, assemble_calls(calls)


def _splits(text: str, seed: int):
    """The ways a text is cut into pieces: at every character boundary (two pieces), character
    by character, and at random token-like boundaries (seeded)."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        pieces, at = [], 0
        while at < len(text):
            n = rng.choice((1, 1, 2, 3, 4, 5, 8, 13))
            pieces.append(text[at:at + n])
            at += n
        yield pieces


def _check_streams(mode: ChatOutputMode, text: str, seed: int = 0) -> tuple[str, list[ToolCall]]:
    """The whole output's (content, calls); every split streams the same content, and the
    arguments fragments of each call concatenate to the whole output's arguments."""
    want = _whole(mode, text)
    for pieces in _splits(text, seed):
        _, content, calls = _stream(mode, pieces)
        assert (content, assemble_calls(calls)) == want, pieces
    return want


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", HERMES, "Checking.\n", [ToolCall("w", '{"city": "Oslo"}'), ToolCall("t", "{}")]),
    ("hermes", "a <tool_call>not json</tool_call>", "a <tool_call>not json</tool_call>", []),
    ("hermes", "cut <tool_call>{\"name\"", "cut <tool_call>{\"name\"", []),
    ("hermes", "a <tool_c b <tool_cal", "a <tool_c b <tool_cal", []),
    ("hermes", '<tool_call>{"x": 1}</tool_call>', '<tool_call>{"x": 1}</tool_call>', []),
    # The arguments are the model's text, as written (spacing, escapes, a "}" or an end tag in a string).
    ("hermes", '<tool_call>{"name":"f","arguments":{"s":"}</tool_call>\\"\\u00e9","n":[1,{"m":2}]}}</tool_call>',
     "", [ToolCall("f", '{"s":"}</tool_call>\\"\\u00e9","n":[1,{"m":2}]}')]),
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', "", [ToolCall("f", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": 5 }</tool_call>', "", [ToolCall("f", "5")]),
    # Arguments written as a JSON string: the string, decoded.
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"e\\": \\"\\ud83d\\ude00\\"}"}</tool_call>',
     "", [ToolCall("f", '{"e": "\U0001F600"}')]),
    # Once named a call stands: a block that breaks off (a missing "}") or is cut.
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>x', "x", [ToolCall("f", '{"a": 1}')]),
    ("hermes", 'a<tool_call>{"name": "f", "arguments": {"a": [1, ', "a", [ToolCall("f", '{"a": [1, ')]),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', "", [ToolCall("f", "{}")]),
    ("hermes", '<tool_call>{"name": "f", ', "", [ToolCall("f", "")]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")]),
    ("llama3_json", ' {"name": "f", "parameters": {"s": "x;y}"}} ;{"no": 1}', '{"no": 1}',
     [ToolCall("f", '{"s": "x;y}"}')]),
    ("llama3_json", '{"name": "f", "parameters": {}}\n\nDone.', "Done.", [ToolCall("f", "{}")]),
    ("llama3_json", "plain {text}", "plain {text}", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("llama3_json", "<|python_tag|> no", "<|python_tag|> no", []),
    ("llama3_json", "<|python_ta", "<|python_ta", []),
])
def test_tool_calls_whole_and_streamed(parser, text, content, calls):
    assert parse_tool_calls(text, parser) == (content, calls)
    assert _check_streams(ChatOutputMode(tool_call_parser=parser), text) == (content, calls)


def _random_value(rng: random.Random, depth: int = 0):
    tricky = ["}", "{", '"', "\\", "</tool_call>", ";", "]", "é", "\U0001F600", "\n", "<", " ", "a"]
    kind = rng.randrange(6 if depth < 3 else 3)
    if kind == 0:
        return "".join(rng.choice(tricky) for _ in range(rng.randrange(6)))
    if kind == 1:
        return rng.choice([0, -1.5, 1e20, 42, True, False, None])
    if kind == 2:
        return "".join(rng.choice("abcxyz") for _ in range(rng.randrange(1, 12)))
    if kind == 3:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def _random_json(rng: random.Random, value) -> str:
    """A value's JSON in one of the ways models write it (spacing, escaping)."""
    return json.dumps(value, ensure_ascii=rng.random() < 0.5,
                      indent=rng.choice([None, None, 2]),
                      separators=rng.choice([None, (",", ":"), (", ", ": ")]))


def _random_call(rng: random.Random, key: str) -> tuple[str, str, dict]:
    """(the call object's text, its arguments' text, the arguments)."""
    args = {f"p{i}": _random_value(rng) for i in range(rng.randrange(4))}
    args_text = _random_json(rng, args)
    name = rng.choice(["get_weather", "f", "search_docs"])
    sp = rng.choice(["", " ", "\n"])
    return f'{{{sp}"name":{sp}"{name}",{sp}"{key}":{sp}{args_text}{sp}}}', args_text, name


@pytest.mark.parametrize("seed", range(12))
def test_random_hermes_outputs_stream_as_a_whole(seed):
    rng = random.Random(seed)
    text, content, calls = "", "", []
    for _ in range(rng.randrange(1, 4)):
        prose = rng.choice(["", "Let me check.", "a <tool_c b", "<", "{x}", "\n"])
        call, args_text, name = _random_call(rng, "arguments")
        text += prose + HERMES_START + rng.choice(["", "\n"]) + call + rng.choice(["", "\n"]) + HERMES_END
        content += prose
        calls.append(ToolCall(name, args_text))
    text += rng.choice(["", "\nDone.", " <tool_ca"])
    content += text[text.rindex(HERMES_END) + len(HERMES_END):]
    mode = ChatOutputMode(tool_call_parser="hermes")
    assert _check_streams(mode, text, seed) == (content, calls)
    for call in calls:
        json.loads(call.arguments)
    _check_cuts(mode, text)


@pytest.mark.parametrize("seed", range(12))
def test_random_llama3_json_outputs_stream_as_a_whole(seed):
    rng = random.Random(seed)
    made = [_random_call(rng, "parameters") for _ in range(rng.randrange(1, 4))]
    text = rng.choice(["", PYTHON_TAG, " "]) + rng.choice(["; ", ";", "\n;\n"]).join(c for c, _, _ in made)
    mode = ChatOutputMode(tool_call_parser="llama3_json")
    assert _check_streams(mode, text, seed) == ("", [ToolCall(n, a) for _, a, n in made])
    _check_cuts(mode, text)


def _check_cuts(mode: ChatOutputMode, text: str) -> None:
    """An output cut anywhere ("length") streams as the same cut output parses whole, and what
    a stream sent before the end is never taken back by more text: it is a prefix of the whole
    output's content, and each call it began has the whole output's name and a prefix of its
    arguments."""
    content, calls = _whole(mode, text)
    for cut in range(len(text) + 1):
        _, streamed, deltas = _stream(mode, list(text[:cut]))
        assert (streamed, assemble_calls(deltas)) == _whole(mode, text[:cut])
        sent_content, sent_calls = _sent(mode, text[:cut])
        assert content.startswith(sent_content) and len(calls) >= len(sent_calls)
        for call, sent in zip(calls, sent_calls):
            assert call.name == sent.name and call.arguments.startswith(sent.arguments)


def _sent(mode: ChatOutputMode, text: str) -> tuple[str, list[ToolCall]]:
    """What a stream had sent after this text, before the output's end."""
    out = ChatChoiceOutput(mode)
    d = out.feed(text)
    return d.content, assemble_calls(d.calls)


def test_reasoning_then_tool_calls():
    mode = ChatOutputMode(reasoning_parser="qwen3", tool_call_parser="hermes")
    text = '<think>need weather</think><tool_call>{"name": "w", "arguments": {"c": "<think>"}}</tool_call>'
    reasoning, content, calls = _stream(mode, list(text))
    assert (reasoning, content) == ("need weather", "")
    assert assemble_calls(calls) == [ToolCall("w", '{"c": "<think>"}')]
    assert _check_streams(mode, text) == ("", [ToolCall("w", '{"c": "<think>"}')])


def test_a_long_call_streams_its_arguments_as_they_come():
    out = ChatChoiceOutput(ChatOutputMode(tool_call_parser="hermes"))
    assert out.feed("Hi <tool_call>\n{") == ("", "Hi ", [])
    assert out.feed('"name": "w"') == ("", "", [CallDelta(0, "w")])
    assert out.feed(', "arguments": {"city": "Os') == ("", "", [CallDelta(0, None, '{"city": "Os')])
    assert out.feed('lo"} ') == ("", "", [CallDelta(0, None, 'lo"}')])   # the outer "}" not yet
    assert out.feed('}\n</tool_') == ("", "", [])
    assert out.feed('call> and') == ("", " and", [])
    assert out.finish() == ("", "", [])
    # A scalar's end and whitespace after a value are held; a "<" outside strings may be the end tag.
    out = ChatChoiceOutput(ChatOutputMode(tool_call_parser="hermes"))
    assert out.feed('<tool_call>{"name": "n", "arguments": 12')[2] == [CallDelta(0, "n"), CallDelta(0, None, "12")]
    assert out.feed("3 \n")[2] == [CallDelta(0, None, "3")]
    assert out.feed("}</tool_call>")[2] == []
    out = ChatChoiceOutput(ChatOutputMode(tool_call_parser="hermes"))
    assert out.feed('<tool_call>{"name": "n", "arguments": {"a": 1<')[2] == [
        CallDelta(0, "n"), CallDelta(0, None, '{"a": 1')]
    assert out.feed("/tool_call>x") == ("", "x", [])


def test_forced_calls_stream():
    named = ChatOutputMode(forced_calls=True, forced_name="w")
    out = ChatChoiceOutput(named)
    assert out.feed('{"city": ') == ("", "", [CallDelta(0, "w"), CallDelta(0, None, '{"city": ')])
    assert out.feed('"Oslo"}') == ("", "", [CallDelta(0, None, '"Oslo"}')])
    assert out.finish() == ("", "", [])
    args = '{"city": "Oslo", "n": [1, 2]}'
    assert _check_streams(named, args) == ("", [ToolCall("w", args)])
    # Cut by max_tokens: the call stands as far as it came, as a whole response has it.
    assert _check_streams(named, '{"city": ') == ("", [ToolCall("w", '{"city": ')])
    assert _check_streams(named, "") == ("", [])
    required = ChatOutputMode(forced_calls=True)
    text = '[{"name": "a", "parameters": {"x": "]}"}}, {"name": "b", "parameters": {}}]'
    assert _check_streams(required, text) == ("", [ToolCall("a", '{"x": "]}"}'), ToolCall("b", "{}")])
    assert _check_streams(required, '[{"name": "a", "para') == ("", [ToolCall("a", "")])
    # No call came: the text is the content (sent at the end).
    assert _check_streams(required, '[{"na') == ('[{"na', [])
    out = ChatChoiceOutput(required)
    assert out.feed('[{"na') == ("", "", [])
    assert out.finish() == ("", '[{"na', [])
    _check_cuts(named, '{"city": "Oslo", "n": [1, 2]}')
    _check_cuts(required, text)


@pytest.mark.parametrize("seed", range(8))
def test_random_forced_outputs_stream_as_a_whole(seed):
    rng = random.Random(seed)
    made = [_random_call(rng, "parameters") for _ in range(rng.randrange(1, 4))]
    text = "[" + ", ".join(c for c, _, _ in made) + "]"
    assert parse_forced_calls(text, None) == [ToolCall(n, a) for _, a, n in made]
    assert _check_streams(ChatOutputMode(forced_calls=True), text, seed) == (
        "", [ToolCall(n, a) for _, a, n in made])
    args = _random_json(rng, {"q": _random_value(rng), "r": _random_value(rng)})
    assert parse_forced_calls(args, "f") == [ToolCall("f", args)]
    assert _check_streams(ChatOutputMode(forced_calls=True, forced_name="f"), args, seed) == (
        "", [ToolCall("f", args)])


def _core_chunks(text: str, pieces: list[str], reason) -> list:
    from specserve.proto import generate_pb2 as pb
    assert "".join(pieces) == text
    chunks = [pb.GenerateChunk(text=p) for p in pieces]
    chunks.append(pb.GenerateChunk(finish=pb.Finish(reason=reason)))
    return chunks


def _accumulate(payloads: list[dict]) -> tuple[Optional[str], list[dict], Optional[str]]:
    """A client's view of a chat stream: content, tool calls (checking OpenAI's delta shapes:
    a call opens with index, id, type, name and arguments "", then only index and arguments,
    one entry per chunk) and the finish_reason (on the last chunk)."""
    content, calls, reasons = "", {}, []
    for p in payloads:
        (choice,) = p["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasons.append(choice["finish_reason"])
        entries = delta.get("tool_calls") or []
        assert len(entries) <= 1
        for e in entries:
            if "id" in e:
                assert e["index"] == len(calls) and e["type"] == "function"
                assert set(e) == {"index", "id", "type", "function"} and e["function"]["arguments"] == ""
                assert set(e["function"]) == {"name", "arguments"}
                calls[e["index"]] = {"id": e["id"], "type": "function",
                                     "function": {"name": e["function"]["name"], "arguments": ""}}
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                assert e["function"]["arguments"] and e["index"] == len(calls) - 1
                calls[e["index"]]["function"]["arguments"] += e["function"]["arguments"]
    assert all(r is None for r in reasons[:-1])
    return content or None, [calls[i] for i in sorted(calls)], reasons[-1]


LONG_HERMES = ('Sure.<tool_call>\n{"name": "search", "arguments": {"query": "a long query, with \\"quotes\\"", '
               '"filters": {"lang": ["en", "de"], "year": 2024}}}\n</tool_call>')


@pytest.mark.parametrize("mode, text", [
    (ChatOutputMode(tool_call_parser="hermes"), LONG_HERMES + "<tool_call>{\"name\": \"t\"}</tool_call>"),
    (ChatOutputMode(tool_call_parser="llama3_json"),
     '{"name": "f", "parameters": {"a":[1,2,3],"b":"x;y \\u00e9"}}; {"name": "g", "parameters": {}}'),
    (ChatOutputMode(forced_calls=True),
     '[{"name": "a", "parameters": {"x": "]}"}}, {"name": "b", "parameters": {}}]'),
    (ChatOutputMode(forced_calls=True, forced_name="w"), '{"city": "Oslo", "unit": "c"}'),
])
@pytest.mark.parametrize("seed", range(3))
def test_sse_chunks_equal_the_whole_response(mode, text, seed):
    from specserve.proto import generate_pb2 as pb
    from specserve.server.fronts.openai.responses import ResponseFormat

    pieces = list(_splits(text, seed))[len(text) + 2 + seed]   # random token-like pieces
    for reason, want_reason in ((pb.FINISH_REASON_STOP, "tool_calls"), (pb.FINISH_REASON_LENGTH, "length")):
        whole = ResponseFormat("r", "m", True, chat_mode=mode).response(_core_chunks(text, pieces, reason))
        message = whole["choices"][0]["message"]
        assert whole["choices"][0]["finish_reason"] == want_reason
        shape = ResponseFormat("r", "m", True, chat_mode=mode)
        payloads = [p for c in _core_chunks(text, pieces, reason) for p in shape.chunks(c)]
        content, calls, finish = _accumulate(payloads)
        assert (content, finish) == (message["content"], want_reason)
        assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
        assert len({c["id"] for c in calls}) == len(calls) >= 1
        # The long calls' arguments come in several fragments, as the text came.
        fragments = sum(1 for p in payloads for e in p["choices"][0]["delta"].get("tool_calls") or []
                        if "id" not in e)
        assert fragments > len(calls)


def test_a_cut_call_streams_what_the_whole_response_says():
    from specserve.proto import generate_pb2 as pb
    from specserve.server.fronts.openai.responses import ResponseFormat

    mode = ChatOutputMode(tool_call_parser="hermes")
    text = LONG_HERMES[:LONG_HERMES.index("quotes")]   # cut by max_tokens in the arguments
    pieces = [text[k:k + 3] for k in range(0, len(text), 3)]
    whole = ResponseFormat("r", "m", True, chat_mode=mode).response(
        _core_chunks(text, pieces, pb.FINISH_REASON_LENGTH))["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] == "Sure."
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "search", "arguments": '{"query": "a long query, with \\"'}
    shape = ResponseFormat("r", "m", True, chat_mode=mode)
    payloads = [p for c in _core_chunks(text, pieces, pb.FINISH_REASON_LENGTH) for p in shape.chunks(c)]
    content, calls, finish = _accumulate(payloads)
    assert (content, [c["function"] for c in calls], finish) == ("Sure.", [call["function"]], "length")


def test_default_parser_from_the_chat_template():
    assert default_tool_call_parser("... <tool_call> ...") == "hermes"
    assert default_tool_call_parser("{{ '<|python_tag|>' }} ...") == "llama3_json"
    assert default_tool_call_parser(None) == "hermes"
