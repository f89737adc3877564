"""SDK pieces that need no server: request building, response assembly, error mapping."""
from __future__ import annotations

import grpc
import pytest

from specserve.clients import (Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted,
                               SpecserveError, Unavailable)
from specserve.clients.errors import error_from_rpc
from specserve.clients.messages import build_request, chunk_from_proto, result_from_chunks
from specserve.server.proto import generate_pb2 as pb


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


def test_chunks_assemble_into_a_result():
    last = pb.GenerateChunk(token_ids=[5], text="b", finish=pb.Finish(
        reason=pb.FINISH_REASON_STOP, matched_stop_str="\n",
        usage=pb.Usage(prompt_tokens=3, completion_tokens=3),
        spec=pb.SpecStats(verify_steps=2, accepted_drafts=1, accept_length=1.5)))
    chunks = [chunk_from_proto(pb.GenerateChunk(token_ids=[3, 4], text="a")), chunk_from_proto(last)]
    assert not chunks[0].is_last and chunks[1].is_last
    result = result_from_chunks(chunks)
    assert (result.text, result.token_ids, result.finish_reason) == ("ab", [3, 4, 5], "stop")
    assert result.matched_stop == "\n" and result.usage.completion_tokens == 3
    assert result.spec.accept_length == 1.5 and result.logprobs is None
    with pytest.raises(RuntimeError):
        result_from_chunks(chunks[:1])


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
