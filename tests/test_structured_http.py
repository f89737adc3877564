"""Structured outputs, tool calls and reasoning output through real speculative servers (a
draft tree), with the official `openai` client (streamed and not) and the gRPC API."""
from __future__ import annotations

import json
import os

import grpc
import jsonschema
import openai
import pytest

from helpers import make_predictable_pair, save_byte_tokenizer
from server_harness import ServerProcess, free_port

from specserve.proto import generate_pb2 as pb
from specserve.proto import generate_pb2_grpc as pb_grpc

# A Hermes-style template: it renders the tools and the calls and tool results in the history.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}; call with <tool_call>{json}</tool_call>\n{% endif %}{% for m in messages %}"
    "<|{{ m['role'] }}|>{% if m['content'] %}{{ m['content'] }}{% endif %}{% if m['tool_calls'] %}"
    "{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}</tool_call>{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "c"\}\}</tool_call>'
LLAMA_CALL = r'\{"name": "get_time", "parameters": \{"zone": "utc"\}\}'


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The predictable pair with <think> and </think> as tokens 320 and 321."""
    from tokenizers import Tokenizer

    target, head = make_predictable_pair(str(tmp_path_factory.mktemp("pair")), vocab_size=324)
    save_byte_tokenizer(target, 320)
    file = os.path.join(target, "tokenizer.json")
    tok = Tokenizer.from_file(file)
    tok.add_tokens(["<think>", "</think>"])
    tok.save(file)
    with open(os.path.join(target, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}, f)
    return target, head


def _serve(pair, *args):
    target, head = pair
    server = ServerProcess(target, "--draft-model", head, "--speculative-algorithm", "eagle",
                           "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                           "--speculative-num-draft-tokens", "6", "--http-port", str(free_port()),
                           *args, speculative=True)
    return server, server.openai_client()


@pytest.fixture(scope="module")
def served(pair):
    server, oai = _serve(pair)
    yield server, oai
    oai.close()
    assert server.stop() == 0


@pytest.fixture(scope="module")
def oai(served):
    return served[1]


def _chat(oai, stream: bool, **kwargs):
    """(reasoning, content, tool calls as (name, arguments), finish_reason) of one choice."""
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
              **kwargs}
    if not stream:
        r = oai.chat.completions.create(model=_model(oai), **kwargs)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return getattr(m, "reasoning_content", None), m.content, calls, r.choices[0].finish_reason
    reasoning, content, calls, finish, _ = _stream_chat(oai, **kwargs)
    return reasoning, content, calls, finish


def _stream_chat(oai, **kwargs):
    """A streamed chat's (reasoning, content, calls, finish_reason, arguments fragments per
    call), checking OpenAI's tool-call delta shapes: a call opens with its index, id, type and
    name (arguments ""), then its deltas carry only the index and arguments fragments."""
    reasoning = content = ""
    calls, fragments, finish = {}, {}, None
    for chunk in oai.chat.completions.create(model=_model(oai), stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for c in delta.tool_calls or []:
            if c.index not in calls:
                assert c.index == len(calls) and c.id.startswith("call_") and c.type == "function"
                assert c.function.name and c.function.arguments == ""
                calls[c.index], fragments[c.index] = [c.function.name, ""], 0
            else:
                assert c.id is None and c.type is None and c.function.name is None
                assert c.function.arguments
                calls[c.index][1] += c.function.arguments
                fragments[c.index] += 1
        assert finish is None   # the finish_reason comes last
        finish = chunk.choices[0].finish_reason
    return (reasoning or None, content or None, [tuple(v) for _, v in sorted(calls.items())], finish,
            [n for _, n in sorted(fragments.items())])


def _model(oai):
    return oai.models.list().data[0].id


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(oai, stream):
    _, content, calls, finish = _chat(oai, stream, response_format={
        "type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
    assert not calls and finish in ("stop", "length")
    if finish == "stop":
        jsonschema.validate(json.loads(content), SCHEMA)


def test_json_object_and_regex_extras(oai):
    _, content, _, finish = _chat(oai, False, response_format={"type": "json_object"})
    assert content.startswith("{") and finish in ("stop", "length")
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    got = oai.completions.create(model=_model(oai), prompt="x", max_tokens=10, temperature=0,
                                 extra_body={"regex": "(yes|no)!"})
    assert got.choices[0].text in ("yes!", "no!") and got.choices[0].finish_reason == "stop"
    got = oai.completions.create(model=_model(oai), prompt="x", max_tokens=10, temperature=0,
                                 extra_body={"ebnf": 'root ::= "a" [0-9] "b"'})
    assert got.choices[0].text[0] == "a" and got.choices[0].text[-1] == "b"


CHOICES = ["yes", 'no "way"', "a\\b", "é ✓"]


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": CHOICES}},
                                   {"guided_choice": CHOICES}], ids=["structured_outputs", "guided"])
def test_choice_outputs_one_of_the_strings(oai, extra):
    """vLLM's choice: whatever is sampled, the text is one of the strings (quotes, backslashes
    and non-ASCII included), then it stops."""
    for seed in range(3):
        got = oai.completions.create(model=_model(oai), prompt="x", max_tokens=16, temperature=1.0,
                                     seed=seed, extra_body=extra)
        assert got.choices[0].text in CHOICES and got.choices[0].finish_reason == "stop", got
    _, content, _, finish = _chat(oai, True, extra_body=extra)
    assert content in CHOICES and finish == "stop"


def _valid_json(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


@pytest.mark.parametrize("options, accepts", [
    ({"regex": "(yes|no)!"}, lambda text: text in ("yes!", "no!")),
    ({"grammar": 'root ::= "a" [0-9] "b"'}, lambda text: len(text) == 3 and text[::2] == "ab"),
    # A random model may not close the JSON within max_tokens (as for response_format above).
    ({"json": SCHEMA}, _valid_json),
    ({"json": json.dumps(SCHEMA)}, _valid_json),
    ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
], ids=["regex", "grammar", "json", "json-as-text", "json_object"])
def test_structured_outputs_options(oai, options, accepts):
    got = oai.completions.create(model=_model(oai), prompt="x", max_tokens=40, temperature=0,
                                 extra_body={"structured_outputs": options})
    text, finish = got.choices[0].text, got.choices[0].finish_reason
    if "json" in options or "json_object" in options:
        assert text.startswith("{") and finish in ("stop", "length"), got
        assert finish == "length" or accepts(text), got
    else:
        assert finish == "stop" and accepts(text), got


def test_unsupported_structured_outputs_options_are_refused_by_name(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=_model(oai), prompt="x", max_tokens=4, extra_body={
            "structured_outputs": {"regex": "a+", "whitespace_pattern": " "}})
    assert e.value.body["param"] == "structured_outputs"
    assert e.value.body["message"].startswith("structured_outputs.whitespace_pattern: ")


def test_a_grammar_that_cannot_finish_ends_with_length(oai):
    got = oai.completions.create(model=_model(oai), prompt="x", max_tokens=4, temperature=0,
                                 extra_body={"regex": "z{9}"})
    assert got.choices[0].text == "zzzz" and got.choices[0].finish_reason == "length"


def _schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}


def _bad_tool(**parameters) -> dict:
    return {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", **parameters}}}


SCHEMA_FIELD = "response_format.json_schema.schema"
CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
DEEP = {"type": "string"}
for _ in range(40):
    DEEP = {"type": "object", "properties": {"k": DEEP}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body, param, says", [
    # The server's own checks (server/text/schema_checks.py), before the engine sees them.
    (_schema_format({"type": "objectx"}), SCHEMA_FIELD, "type must be one of"),
    (_schema_format({"type": "array", "minItems": -1}), SCHEMA_FIELD, "minItems must be a non-negative"),
    (_schema_format(CYCLE), SCHEMA_FIELD, "$ref cycle"),
    (_schema_format(DEEP), SCHEMA_FIELD, "nested deeper than"),
    ({"tools": [WEATHER, _bad_tool(properties={"a": {"type": "string", "maxLength": -2}})],
      "tool_choice": "auto"}, "tools[1].function.parameters", "maxLength must be a non-negative"),
    ({"tools": [_bad_tool(**CYCLE)]}, "tools[0].function.parameters", "$ref cycle"),
    ({"tools": [_bad_tool(required="city")], "tool_choice": "none"}, "tools[0].function.parameters",
     "required must be a list"),
    # Compiled by the engine's grammar process, which fails it by name (INVALID_ARGUMENT).
    ({"regex": "a(b"}, "regex", "regex: "),
    ({"ebnf": "root ::= nothing"}, "ebnf", "ebnf: "),
    ({"tools": [WEATHER, _bad_tool(properties={"s": {"type": "string", "pattern": "a(b"}})],
      "tool_choice": {"type": "function", "function": {"name": "bad"}}}, "tools[1].function.parameters",
     "tools[1].function.parameters: "),
    # The bodies' own rules.
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "only one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "no tool is named"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    # vLLM's structured_outputs and guided_* spellings.
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
    ({"guided_choice": []}, "guided_choice", ""),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", ""),
    ({"regex": "a", "structured_outputs": {"choice": ["a"]}}, "structured_outputs", ""),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", ""),
    ({"guided_regex": "a(b"}, "guided_regex", ""),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", ""),
])
def test_bad_grammars_are_refused_by_name(oai, body, param, says, stream):
    """400 naming the field, streamed or not (a stream's first event is awaited before its
    status is sent), whether the server or the engine's grammar process found the fault."""
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=_model(oai), messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4, stream=stream, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error" and says in e.value.body["message"]
    assert e.value.body["message"].startswith(f"{param}: ")


def test_grpc_structured_output_and_refusal(served):
    server, _ = served
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        chunks = list(stub.Generate(pb.GenerateRequest(
            text="x", sampling=pb.SamplingParams(max_new_tokens=20, temperature=0),
            structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA)))))
        text = "".join(c.text for c in chunks)
        if chunks[-1].finish.reason == pb.FINISH_REASON_STOP:
            jsonschema.validate(json.loads(text), SCHEMA)
        assert chunks[-1].finish.spec.verify_steps > 0
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="x", structured_output=pb.StructuredOutput(regex="a("))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("structured_output.regex:")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="x", structured_output=pb.StructuredOutput(
                json_schema=json.dumps({"type": "array", "minItems": -1})))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("structured_output.json_schema: minItems")


def test_sdk_structured_output(served):
    server, _ = served
    with server.client() as client:
        got = client.generate("x", max_new_tokens=20, temperature=0,
                              structured_output={"json_schema": SCHEMA})
        if got.finish_reason == "stop":
            jsonschema.validate(json.loads(got.text), SCHEMA)
        assert client.generate("x", max_new_tokens=8, temperature=0,
                               structured_output={"regex": "(yes|no)!"}).text in ("yes!", "no!")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named_and_required(oai, stream):
    _, content, calls, finish = _chat(oai, stream, tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    assert finish == "tool_calls" and content is None and [c[0] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
    _, content, calls, finish = _chat(oai, stream, tools=[WEATHER, TIME], tool_choice="required",
                                      max_tokens=80, parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0][0] in ("get_weather", "get_time")


ORDER = {"type": "function", "function": {"name": "order", "parameters": {
    "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
    "additionalProperties": False,
    "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 3},
                                                        "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["sku", "qty"], "additionalProperties": False}}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_with_refs(oai, stream):
    """A tool whose parameters use $defs/$ref, under tool_choice required (its parameters
    sit inside the calls' array schema): the call's arguments validate against its schema."""
    _, content, calls, finish = _chat(oai, stream, tools=[ORDER, TIME], tool_choice="required",
                                      max_tokens=120, parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
    name, arguments = calls[0]
    tool = {"order": ORDER, "get_time": TIME}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_parses_hermes_calls(oai, stream):
    # The model's own choice is forced with a regex, so that the parser has a call to find.
    _, content, calls, finish = _chat(oai, stream, tools=[WEATHER], max_tokens=120,
                                      extra_body={"regex": r"Sure\." + HERMES_CALL})
    assert finish == "tool_calls" and content == "Sure."
    assert calls == [("get_weather", '{"city": "Oslo", "unit": "c"}')]
    _, content, calls, finish = _chat(oai, stream, tools=[WEATHER], extra_body={"regex": "no call"})
    assert (content, calls, finish) == ("no call", [], "stop")


LONG_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "c", '
             r'"note": "a longer argument, \\"quoted\\", and \}\]<tool_call> inside"\}\}</tool_call>')


@pytest.mark.parametrize("kwargs", [
    {"tools": [WEATHER], "extra_body": {"regex": r"Sure\." + LONG_CALL + r"\n" + HERMES_CALL + r" Done\."}},
    {"tools": [WEATHER], "max_tokens": 90, "extra_body": {"regex": r"Sure\." + LONG_CALL}},   # cut in the call
    {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
], ids=["hermes", "hermes-length", "named", "required"])
def test_streamed_tool_calls_equal_whole_ones(oai, kwargs):
    """Streams send calls incrementally: a name, then arguments fragments that add up to the
    non-streamed arguments (the same for a call cut by max_tokens: finish_reason "length")."""
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "temperature": 0, **kwargs}
    r = oai.chat.completions.create(model=_model(oai), **kwargs)
    m = r.choices[0].message
    want = (m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []],
            r.choices[0].finish_reason)
    _, content, calls, finish, fragments = _stream_chat(oai, **kwargs)
    assert (content, calls, finish) == want
    assert calls and finish == ("length" if kwargs["max_tokens"] == 90 else "tool_calls")
    assert max(fragments) > 1   # a long call's arguments come in several deltas
    if finish == "tool_calls":
        for _, arguments in calls:
            json.loads(arguments)


def test_streamed_llama3_json_calls_equal_whole_ones(llama_oai):
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "temperature": 0,
              "tools": [TIME], "extra_body": {"regex": LLAMA_CALL + "; " + LLAMA_CALL.replace("utc", "cet")}}
    want = _chat(llama_oai, False, **kwargs)
    assert want[2] == [("get_time", '{"zone": "utc"}'), ("get_time", '{"zone": "cet"}')]
    _, content, calls, finish, fragments = _stream_chat(llama_oai, **kwargs)
    assert (None, content, calls, finish) == want and fragments[0] > 1


def test_tool_choice_none_and_tool_results_in_history(oai):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = oai.chat.completions.create(model=_model(oai), messages=messages, tools=[WEATHER],
                                    tool_choice="none", max_tokens=120, temperature=0,
                                    extra_body={"regex": HERMES_CALL})
    # With tool_choice none nothing is parsed as a call, even text in the call format.
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content.startswith("<tool_call>")


@pytest.fixture(scope="module")
def llama_oai(pair):
    server, oai = _serve(pair, "--tool-call-parser", "llama3_json")
    yield oai
    oai.close()
    assert server.stop() == 0


@pytest.fixture(scope="module")
def reasoning_oai(pair):
    server, oai = _serve(pair, "--reasoning-parser", "deepseek-r1")
    yield oai
    oai.close()
    assert server.stop() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_json_tool_call_parser(llama_oai, stream):
    _, content, calls, finish = _chat(llama_oai, stream, tools=[TIME], max_tokens=80,
                                      extra_body={"regex": LLAMA_CALL})
    assert (content, calls, finish) == (None, [("get_time", '{"zone": "utc"}')], "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_split_and_grammar_after_it(reasoning_oai, stream):
    oai = reasoning_oai
    # The output starts inside the thinking (deepseek-r1: the template opened it), so without
    # a </think> everything is reasoning.
    reasoning, content, _, _ = _chat(oai, stream, max_tokens=5, extra_body={"ignore_eos": True})
    assert reasoning and content is None
    # logit_bias makes the model end the thinking at once (</think> is token 321); what follows
    # is content, a later </think> included.
    reasoning, content, _, _ = _chat(oai, stream, max_tokens=3, logit_bias={"321": 100},
                                     extra_body={"ignore_eos": True})
    assert (reasoning, content) == (None, "</think></think>")
    # The grammar waits for the end of the thinking, then applies (it bans a second </think>).
    reasoning, content, _, finish = _chat(oai, stream, max_tokens=12, logit_bias={"321": 100},
                                          extra_body={"regex": "(yes|no)"})
    assert reasoning is None and content in ("yes", "no") and finish == "stop"
