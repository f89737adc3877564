"""SDK pieces that need no server: request building and client-side value checks, response
assembly, error mapping."""
from __future__ import annotations

import grpc
import pytest

from specserve.clients import (AsyncClient, Cancelled, Client, DeadlineExceeded, InvalidArgument,
                               ResourceExhausted, SpecserveError, Unavailable)
from specserve.clients.errors import error_from_rpc
from specserve.clients.messages import (build_request, build_tokenize_request, chunk_from_proto,
                                        one_or_all, results_from_chunks)
from specserve.proto import generate_pb2 as pb


def test_only_given_options_are_sent():
    request = build_request("hi", None, {"temperature": 0.0, "top_p": None, "stop": "\n"})
    assert request.text == "hi"
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert not request.sampling.HasField("top_p")
    assert not request.sampling.HasField("max_new_tokens")
    assert list(request.sampling.stop) == ["\n"]
    request = build_request(None, [1, 2, 3], {"stop_token_ids": [7], "seed": 2**40})
    assert list(request.token_ids.ids) == [1, 2, 3] and request.sampling.seed == 2**40


@pytest.mark.parametrize("prompt, ids, options", [
    (None, None, {}), ("hi", [1], {}), ("hi", None, {"temprature": 0.5})])
def test_bad_arguments_are_type_errors(prompt, ids, options):
    with pytest.raises(TypeError):
        build_request(prompt, ids, options)


def test_accepted_value_forms():
    request = build_request("hi", None, {"max_new_tokens": 2**32 - 1, "top_k": -1,
                                         "seed": 2**64 - 1, "temperature": 0, "stop": ("a", "b"),
                                         "stop_token_ids": 7, "logprobs": True})
    sampling = request.sampling
    assert (sampling.max_new_tokens, sampling.top_k, sampling.seed) == (2**32 - 1, -1, 2**64 - 1)
    assert sampling.temperature == 0.0 and sampling.logprobs
    assert list(sampling.stop) == ["a", "b"] and list(sampling.stop_token_ids) == [7]
    assert list(build_request(None, range(3), {}).token_ids.ids) == [0, 1, 2]


def test_messages_and_add_special_tokens_are_sent():
    request = build_request(None, None, {}, messages=[{"role": "user", "content": "hi"}],
                            add_special_tokens=True)
    assert request.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in request.messages.messages] == [("user", "hi")]
    assert request.HasField("add_special_tokens") and request.add_special_tokens
    assert not build_request("hi", None, {}).HasField("add_special_tokens")
    tokenize = build_tokenize_request(None, [{"role": "user", "content": "hi"}], None, False)
    assert tokenize.WhichOneof("prompt") == "messages"
    assert not tokenize.HasField("add_special_tokens") and tokenize.HasField(
        "add_generation_prompt") and not tokenize.add_generation_prompt
    with pytest.raises(TypeError):
        build_request("hi", None, {}, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError):
        build_tokenize_request(None, None, None, None)


# (argument, bad value): every value the request message cannot carry as the caller meant it.
BAD_VALUES = [
    ("prompt", [1, 2, 3]), ("prompt", b"hi"), ("prompt", "\ud800"),
    ("prompt_token_ids", "abc"), ("prompt_token_ids", 5), ("prompt_token_ids", [1, -1]),
    ("prompt_token_ids", [2**32]), ("prompt_token_ids", [1.0]), ("prompt_token_ids", [True]),
    ("max_new_tokens", -1), ("max_new_tokens", 2**32), ("max_new_tokens", 8.0),
    ("max_new_tokens", True), ("max_new_tokens", "8"),
    ("min_new_tokens", -1), ("min_new_tokens", 2**32),
    ("top_k", 2**31), ("top_k", -2**31 - 1), ("top_k", 2.0),
    ("seed", -1), ("seed", 2**64), ("seed", "7"), ("seed", False),
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 1e39),
    ("temperature", "0.5"), ("temperature", True),
    ("top_p", float("-inf")), ("top_p", [0.9]),
    ("min_p", float("nan")), ("min_p", "x"),
    ("repetition_penalty", float("inf")), ("repetition_penalty", "1.1"),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("logprobs", 0), ("logprobs", "true"),
    ("top_logprobs", -1), ("top_logprobs", 2.0), ("prompt_logprobs", True), ("prompt_logprobs", 2**32),
    ("presence_penalty", float("nan")), ("frequency_penalty", "0.5"),
    ("logit_bias", [1, 2]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"7": 1.0}),
    ("logit_bias", {7: float("inf")}), ("logit_bias", {7: "1"}),
    ("stop", 5), ("stop", b"\n"), ("stop", ["ok", 3]), ("stop", "\ud800"),
    ("stop_token_ids", -1), ("stop_token_ids", [1, -2]), ("stop_token_ids", "7"),
    ("stop_token_ids", [2**32]), ("stop_token_ids", [1.5]),
    ("messages", "hi"), ("messages", [{"role": "user"}]), ("messages", [("user", "hi")]),
    ("messages", [{"role": "user", "content": 5}]),
    ("messages", [{"role": "user", "content": "hi", "name": "x"}]),
    ("add_special_tokens", 1),
]


def _call_arguments(field: str, value) -> dict:
    if field in ("prompt", "prompt_token_ids", "messages"):
        return {field: value}
    return {"prompt": "hi", field: value}


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_sync_client_refuses_bad_values_naming_the_field(field, value):
    with Client("127.0.0.1:1") as client:  # never contacted: the values are refused first
        for call in (client.generate, client.generate_stream):
            with pytest.raises(InvalidArgument, match=f"^INVALID_ARGUMENT: {field}: ") as error:
                call(**_call_arguments(field, value))
            assert error.value.details.startswith(f"{field}: ")


@pytest.mark.parametrize("call, field", [
    (lambda c: c.tokenize(messages=[{"role": 1, "content": "hi"}]), "messages"),
    (lambda c: c.tokenize(["not", "text"]), "prompt"),
    (lambda c: c.tokenize("hi", add_generation_prompt="yes"), "add_generation_prompt"),
    (lambda c: c.detokenize([1, -1]), "token_ids"),
    (lambda c: c.detokenize("abc"), "token_ids"),
])
def test_tokenize_and_detokenize_refuse_bad_values_naming_the_field(call, field):
    with Client("127.0.0.1:1") as client:  # never contacted
        with pytest.raises(InvalidArgument, match=f"^INVALID_ARGUMENT: {field}: "):
            call(client)


@pytest.mark.asyncio
@pytest.mark.parametrize("field, value", BAD_VALUES)
async def test_async_client_refuses_bad_values_naming_the_field(field, value):
    async with AsyncClient("127.0.0.1:1") as client:
        with pytest.raises(InvalidArgument, match=f"^INVALID_ARGUMENT: {field}: "):
            client.generate_stream(**_call_arguments(field, value))
        with pytest.raises(InvalidArgument, match=f"^INVALID_ARGUMENT: {field}: "):
            await client.generate(**_call_arguments(field, value))


def test_chunks_assemble_into_a_result():
    last = pb.GenerateChunk(token_ids=[5], text="b", finish=pb.Finish(
        reason=pb.FINISH_REASON_STOP, matched_stop_str="\n",
        usage=pb.Usage(prompt_tokens=3, completion_tokens=3),
        spec=pb.SpecStats(verify_steps=2, accepted_drafts=1, accept_length=1.5)))
    chunks = [chunk_from_proto(pb.GenerateChunk(token_ids=[3, 4], text="a")), chunk_from_proto(last)]
    assert not chunks[0].is_last and chunks[1].is_last
    [result] = results_from_chunks(chunks)
    assert (result.text, result.token_ids, result.finish_reason) == ("ab", [3, 4, 5], "stop")
    assert result.matched_stop == "\n" and result.usage.completion_tokens == 3
    assert result.spec.accept_length == 1.5 and result.logprobs is None
    with pytest.raises(RuntimeError):
        results_from_chunks(chunks[:1])


def test_chunks_of_n_sequences_assemble_by_index():
    def finish(n):
        return pb.Finish(reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=2, completion_tokens=n))

    chunks = [chunk_from_proto(c) for c in [
        pb.GenerateChunk(token_ids=[3], text="a", index=1), pb.GenerateChunk(token_ids=[4], text="b"),
        pb.GenerateChunk(token_ids=[5], text="c", index=1, finish=finish(2)),
        pb.GenerateChunk(token_ids=[], text="", finish=finish(1))]]
    results = results_from_chunks(chunks)
    assert [(r.index, r.text, r.token_ids) for r in results] == [(0, "b", [4]), (1, "ac", [3, 5])]
    assert one_or_all(results, {"n": 2}) == results and one_or_all(results[:1], {}) == results[0]


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "why"


@pytest.mark.parametrize("code, error_type", [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    (grpc.StatusCode.UNAVAILABLE, Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
    (grpc.StatusCode.CANCELLED, Cancelled),
    (grpc.StatusCode.INTERNAL, SpecserveError),
])
def test_status_codes_map_to_typed_errors(code, error_type):
    error = error_from_rpc(_FakeRpcError(code))
    assert type(error) is error_type and error.code == code and error.details == "why"
