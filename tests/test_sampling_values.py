"""Sampling values at the edges ([E11] fault 6): numerically greedy temperatures act as greedy,
values that cannot work are refused naming the field, in the engine and through the server."""
from __future__ import annotations

import math

import grpc
import pytest

from server_harness import ServerProcess
from specserve.engine import SamplingParams
from specserve.engine.config import GREEDY_TEMPERATURE
from specserve.proto import generate_pb2 as pb
from specserve.proto import generate_pb2_grpc as pb_grpc

PROMPTS = [[5, 9, 17, 33], [40, 41, 42]]


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, GREEDY_TEMPERATURE / 2])
def test_tiny_temperature_samples_greedily(tiny_model, make_engine, temperature):
    engine = make_engine(tiny_model)
    greedy = engine.generate(prompt_token_ids=PROMPTS, sampling=SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True))
    tiny = engine.generate(prompt_token_ids=PROMPTS, sampling=SamplingParams(
        max_new_tokens=12, temperature=temperature, ignore_eos=True, seed=7))
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]
    assert len(set(tiny[0].token_ids)) > 1  # a real sequence, not token 0 forever


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1e-45), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", 1e3), ("repetition_penalty", math.inf),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5),
    ("top_p", math.nan), ("min_p", math.inf), ("top_p", 0.0),
])
def test_values_that_cannot_work_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})


def test_server_refuses_and_accepts_edge_values(tiny_model):
    """Raw messages, so that the SDK's own checks do not answer first."""
    server = ServerProcess(tiny_model)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)

            def generate(**sampling) -> list[int]:
                request = pb.GenerateRequest(text="def add(a, b):", sampling=pb.SamplingParams(
                    max_new_tokens=8, ignore_eos=True, **sampling))
                return [t for chunk in stub.Generate(request) for t in chunk.token_ids]

            with pytest.raises(grpc.RpcError) as refused:
                generate(repetition_penalty=1e-45)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith("repetition_penalty: ")
            assert generate(temperature=1e-45) == generate(temperature=0.0)
    finally:
        assert server.stop() == 0
