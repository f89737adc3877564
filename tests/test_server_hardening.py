"""Hostile input and exposure: oversized fields are refused by name before any slow work, and
tokenizing runs off the event loop; malformed bytes are INVALID_ARGUMENT, logged in one line and
counted; the HTTP port serves /metrics and /health only; reflection can be off; model info gives
names, not server paths."""
from __future__ import annotations

import asyncio
import os
import re
import threading

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from server_harness import ServerProcess, free_port, http_get, wait_until
from specserve.engine.config import EngineConfig
from specserve.engine.outputs import EngineInfo, EngineLoad
from specserve.proto import generate_pb2 as pb
from specserve.proto import generate_pb2_grpc as pb_grpc
from specserve.server.config import ServerConfig
from specserve.server.generation import GenerationCore
from specserve.server.ops.health import GENERATION_SERVICE
from specserve.server.ops.metrics import ServerMetrics
from specserve.server.ops.watchdog import EngineWatchdog
from specserve.server.text.validation import TEXT_BYTES_PER_TOKEN

MAX_PROMPT_TOKENS = 24
MAX_TEXT_BYTES = MAX_PROMPT_TOKENS * TEXT_BYTES_PER_TOKEN
GENERATE = f"/{GENERATION_SERVICE}/Generate"


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tiny_model, metrics_port):
    # The default max_message_bytes (16 MiB): messages far over the text limit get through.
    server = ServerProcess(tiny_model, "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
                           "--metrics-port", str(metrics_port), "--no-reflection")
    yield server
    assert server.stop() == 0


def _refusal(server, request: pb.GenerateRequest) -> grpc.RpcError:
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
    return info.value


# --- 3: sizes first, tokenizing off the event loop -------------------------------------------
@pytest.mark.parametrize("request_fields, field, limit", [
    ({"text": "x" * (MAX_TEXT_BYTES + 1)}, "text", f"{MAX_TEXT_BYTES} UTF-8 bytes"),
    # Fewer characters than the limit, more bytes.
    ({"text": "é" * (MAX_TEXT_BYTES // 2 + 1)}, "text", f"{MAX_TEXT_BYTES} UTF-8 bytes"),
    # Counted before any id is looked at (these ids are not even in the vocabulary).
    ({"token_ids": pb.TokenIds(ids=[1000] * (MAX_PROMPT_TOKENS + 1))}, "token_ids",
     f"max_prompt_tokens={MAX_PROMPT_TOKENS}"),
    ({"text": "hi", "sampling": pb.SamplingParams(stop=["x" * 257])}, "stop", "256 characters"),
    ({"text": "hi", "sampling": pb.SamplingParams(stop_token_ids=[5] * 257)}, "stop_token_ids",
     "at most 256"),
])
def test_oversized_fields_are_refused_by_name(server, request_fields, field, limit):
    error = _refusal(server, pb.GenerateRequest(**request_fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}:") and limit in error.details(), error.details()


def test_huge_text_is_refused_unread_while_other_calls_go_on(server, client):
    with client.generate_stream("def add", max_new_tokens=64, ignore_eos=True) as stream:
        chunks = iter(stream)
        first = next(chunks)
        error = _refusal(server, pb.GenerateRequest(text="def add(a, b): " * 500_000))  # 7.5 MB
        assert client.health() == "SERVING"
        rest = list(chunks)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"text: longer than the server limit of {MAX_TEXT_BYTES}")
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 64


@pytest.mark.asyncio
async def test_tokenizing_runs_off_the_event_loop():
    """A tokenizer that blocks until released: the event loop keeps running meanwhile."""
    started, release = threading.Event(), threading.Event()

    class BlockingTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            started.set()
            assert release.wait(60)
            return [5, 6]

    core = GenerationCore(None, EngineConfig(), ServerConfig(tokenizer_workers=0),
                          ServerMetrics(EngineWatchdog(4.0, None).report))
    core.on_engine_ready(EngineInfo(
        model="m", architecture="llama", vocab_size=320, max_context_len=64, dtype="float32",
        device="cpu", eos_token_ids=(2,), spec=None), BlockingTokenizer())
    try:
        prepared = asyncio.ensure_future(core.in_prepare_thread(
            lambda served: served.validator.validate(pb.GenerateRequest(text="hi")), core.served))
        while not started.is_set():  # never reached if encode ran on this loop
            await asyncio.sleep(0.01)
        assert not prepared.done()
        release.set()
        assert (await prepared).prompt_token_ids == [5, 6]
    finally:
        release.set()
        core.close()


# --- 4: malformed messages --------------------------------------------------------------------
def _requests_counted(metrics_port: int, code: str) -> float:
    body = http_get(f"http://127.0.0.1:{metrics_port}/metrics")[1]
    match = re.search(rf'^specserve_requests_total{{code="{code}"}} (\S+)$', body, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _invalid_utf8(field: int) -> bytes:
    return bytes([field << 3 | 2, 2]) + b"\xff\xfe"  # a length-delimited field holding 0xff 0xfe


MALFORMED = {
    "garbage": b"\xff\xff\xff\xff\xff",
    "text": _invalid_utf8(1),
    "stop": bytes([3 << 3 | 2, 4]) + _invalid_utf8(8) + bytes([1 << 3 | 2, 1]) + b"x",
}


def test_malformed_messages_are_invalid_argument_logged_once_and_counted(server, metrics_port):
    before = _requests_counted(metrics_port, "INVALID_ARGUMENT")
    log_lines_before = len(server.log)
    with grpc.insecure_channel(server.address) as channel:
        generate = channel.unary_stream(GENERATE, request_serializer=None,
                                        response_deserializer=None)
        for name, data in MALFORMED.items():
            with pytest.raises(grpc.RpcError) as info:
                list(generate(data, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            details = info.value.details()
            assert details.startswith("request: not a valid GenerateRequest message"), details
            assert not re.search(r"<class|DecodeError|Unexpected", details), details
        model_info = channel.unary_unary(f"/{GENERATION_SERVICE}/GetModelInfo",
                                         request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            model_info(MALFORMED["garbage"], timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _requests_counted(metrics_port, "INVALID_ARGUMENT") == before + len(MALFORMED)

    def refusals_logged() -> int:
        return sum("refused with INVALID_ARGUMENT: request:" in line
                   for line in server.log[log_lines_before:])

    # One line per refused call (the log is read by a thread: wait for the last one).
    assert wait_until(lambda: refusals_logged() >= len(MALFORMED) + 1)
    assert refusals_logged() == len(MALFORMED) + 1
    assert not any("Traceback" in line for line in server.log)


# --- 12: the HTTP port --------------------------------------------------------------------------
def test_http_port_serves_metrics_and_health_only(server, metrics_port):
    url = f"http://127.0.0.1:{metrics_port}"
    status, body = http_get(f"{url}/metrics")
    assert status == 200 and "specserve_requests_total" in body
    assert "specserve_engine_retractions_total" in body
    assert 'specserve_engine_watchdog{specserve_engine_watchdog="ok"} 1.0' in body
    assert http_get(f"{url}/health") == (200, "SERVING\n")
    for path in ("/", "/metricsx", "/metrics/x", "/favicon.ico"):
        assert http_get(f"{url}{path}")[0] == 404, path


def test_retractions_are_counted_from_the_engine_total():
    metrics = ServerMetrics(EngineWatchdog(4.0, None).report)
    for total in (3, 5, 4):  # 4: an older report arriving late
        metrics.observe_load(EngineLoad(0, 0, 0, 1, 0.0, num_retractions=total))
    assert metrics.registry.get_sample_value("specserve_engine_retractions_total") == 5


# --- 13: reflection off, names not paths ----------------------------------------------------------
def test_reflection_can_be_turned_off(server):
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                   request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                   response_deserializer=rpb.ServerReflectionResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(v1(iter([rpb.ServerReflectionRequest(list_services="")]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_model_info_names_the_model_without_its_path(client, tiny_model):
    assert client.model_info().model == os.path.basename(tiny_model)
