"""Refusals through a real server: each invalid field and each limit gets its status code and
names what was wrong, and a fuzzed request never crashes the server or leaks KV."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_harness import ServerProcess, engine_is_idle, wait_until
from specserve.clients import InvalidArgument, ResourceExhausted
from specserve.proto import generate_pb2 as pb
from specserve.proto import generate_pb2_grpc as pb_grpc

MAX_PROMPT_TOKENS = 24
MAX_NEW_TOKENS_CAP = 400  # long enough that two capped streams overlap for a while
MAX_MESSAGE_BYTES = 16 * 1024
MAX_RUNNING, MAX_QUEUE = 1, 1


@pytest.fixture(scope="module")
def server(tiny_model):
    server = ServerProcess(
        tiny_model, "--max-running-requests", str(MAX_RUNNING), "--max-queue", str(MAX_QUEUE),
        "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
        "--max-new-tokens-cap", str(MAX_NEW_TOKENS_CAP),
        "--max-message-bytes", str(MAX_MESSAGE_BYTES))
    yield server
    assert server.stop() == 0


@pytest.mark.parametrize("prompt, sampling, field", [
    ({}, {}, "prompt"),
    ({"text": ""}, {}, "text"),
    ({"token_ids": []}, {}, "token_ids"),
    ({"token_ids": [5, 320]}, {}, "token_ids"),
    ({"text": "hi"}, {"temperature": -1.0}, "temperature"),
    ({"text": "hi"}, {"temperature": float("nan")}, "temperature"),
    ({"text": "hi"}, {"top_p": 0.0}, "top_p"),
    ({"text": "hi"}, {"top_p": 1.5}, "top_p"),
    ({"text": "hi"}, {"top_k": -2}, "top_k"),
    ({"text": "hi"}, {"min_p": 1.0}, "min_p"),
    ({"text": "hi"}, {"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"text": "hi"}, {"max_new_tokens": 0}, "max_new_tokens"),
    ({"text": "hi"}, {"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens"),
    ({"text": "hi"}, {"seed": 2**63}, "seed"),
    ({"text": "hi"}, {"stop": [""]}, "stop"),
    ({"text": "hi"}, {"stop": ["x"] * 17}, "stop"),
    ({"text": "hi"}, {"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"text": "hi"}, {"presence_penalty": 2.5}, "presence_penalty"),
    ({"text": "hi"}, {"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"text": "hi"}, {"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"text": "hi"}, {"logit_bias": {1000: 1.0}}, "logit_bias"),
    ({"text": "hi"}, {"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"text": "hi"}, {"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ({"text": "hi"}, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"text": "hi"}, {"top_logprobs": 3}, "top_logprobs"),
    ({"text": "hi"}, {"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_invalid_field_is_named(server, prompt, sampling, field):
    request = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    if "text" in prompt:
        request.text = prompt["text"]
    if "token_ids" in prompt:
        request.token_ids.ids.extend(prompt["token_ids"])
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:"), info.value.details()


def test_invalid_requests_do_not_disturb_a_running_stream(client):
    with client.generate_stream("def add", max_new_tokens=MAX_NEW_TOKENS_CAP, ignore_eos=True,
                                temperature=0) as stream:
        chunks = iter(stream)
        first = next(chunks)
        for bad in ({"temperature": -1.0}, {"top_p": 2.0}, {"max_new_tokens": 0}):
            with pytest.raises(InvalidArgument):
                client.generate("hi", **bad)
        rest = list(chunks)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == MAX_NEW_TOKENS_CAP


def test_prompt_over_the_limit_names_it(client):
    with pytest.raises(InvalidArgument, match=f"max_prompt_tokens={MAX_PROMPT_TOKENS}"):
        client.generate(prompt_token_ids=[5] * (MAX_PROMPT_TOKENS + 1))
    assert client.generate(prompt_token_ids=[5] * MAX_PROMPT_TOKENS, max_new_tokens=2)


def test_max_new_tokens_over_the_cap_names_it(client):
    with pytest.raises(InvalidArgument, match=f"max_new_tokens_cap={MAX_NEW_TOKENS_CAP}"):
        client.generate("hi", max_new_tokens=MAX_NEW_TOKENS_CAP + 1)
    info = client.model_info()
    assert (info.max_prompt_tokens, info.max_new_tokens_cap) == (MAX_PROMPT_TOKENS,
                                                                  MAX_NEW_TOKENS_CAP)


def test_oversized_message_names_the_limit(client):
    with pytest.raises(ResourceExhausted, match=str(MAX_MESSAGE_BYTES)):
        client.generate("x" * (MAX_MESSAGE_BYTES + 1))


def test_full_queue_is_resource_exhausted(client):
    streams = [client.generate_stream("def add", max_new_tokens=MAX_NEW_TOKENS_CAP,
                                      ignore_eos=True) for _ in range(MAX_RUNNING + MAX_QUEUE)]
    # One is decoding, the other waits in the engine; both hold an admission slot.
    assert wait_until(lambda: client.server_load().num_active_streams == MAX_RUNNING + MAX_QUEUE)
    with pytest.raises(ResourceExhausted, match="max_running_requests \\+ max_queue = 2"):
        client.generate("hi", max_new_tokens=2)
    for stream in streams:
        stream.cancel()
    assert wait_until(lambda: engine_is_idle(client) and
                      client.server_load().num_active_streams == 0)
    assert client.generate("hi", max_new_tokens=2).usage.completion_tokens == 2


_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
_sampling = st.fixed_dictionaries({}, optional={
    "temperature": _floats, "top_p": _floats, "min_p": _floats, "repetition_penalty": _floats,
    "top_k": st.integers(-2**31, 2**31 - 1),
    "max_new_tokens": st.one_of(st.integers(0, 6), st.integers(0, 2**32 - 1)),
    "min_new_tokens": st.integers(0, 8),
    "stop": st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 400), max_size=3),
    "ignore_eos": st.booleans(), "seed": st.integers(0, 2**64 - 1), "logprobs": st.booleans(),
    "presence_penalty": _floats, "frequency_penalty": _floats,
    "logit_bias": st.dictionaries(st.integers(0, 400), _floats, max_size=3),
    "top_logprobs": st.integers(0, 25), "prompt_logprobs": st.integers(0, 25),
})
_requests = st.builds(
    lambda prompt, sampling: pb.GenerateRequest(**prompt, sampling=pb.SamplingParams(**sampling)),
    st.one_of(st.just({}), st.fixed_dictionaries({"text": st.text(max_size=12)}),
              st.fixed_dictionaries({"token_ids": st.builds(
                  lambda ids: pb.TokenIds(ids=ids), st.lists(st.integers(0, 400), max_size=30))})),
    _sampling)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=_requests)
def test_fuzzed_requests_get_valid_status_codes(server, request):
    with grpc.insecure_channel(server.address) as channel:
        try:
            chunks = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert ":" in e.details()
        else:
            assert chunks[-1].HasField("finish")
            assert chunks[-1].finish.usage.completion_tokens == sum(len(c.token_ids)
                                                                    for c in chunks)


def test_fuzzing_left_the_server_healthy_and_idle(client):
    assert client.health() == "SERVING"
    assert wait_until(lambda: engine_is_idle(client))
