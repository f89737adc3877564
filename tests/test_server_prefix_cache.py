"""The prefix cache through a real server: cached_tokens in gRPC and OpenAI usage, the load's
cache size and hit rate, the metrics, FlushCache, and --disable-prefix-cache."""
from __future__ import annotations

import os

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import make_tiny_checkpoint, random_prompts
from server_harness import ServerProcess, engine_is_idle, free_port, http_get, wait_until
from specserve.proto import generate_pb2 as pb

PROMPT = random_prompts(1, seed=21, min_len=30, max_len=30)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("cache-llama")), "llama")


@pytest.fixture(scope="module")
def server(model):
    metrics_port = free_port()
    server = ServerProcess(model, "--http-port", str(free_port()), "--metrics-port", str(metrics_port))
    server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield server
    assert server.stop() == 0


def _metric(server, name: str) -> float:
    status, body = http_get(server.metrics_url)
    assert status == 200
    return next(s.value for family in text_string_to_metric_families(body) for s in family.samples
                if s.name == name)


def test_repeated_prompt_reports_cached_tokens_and_the_same_output(server, client):
    client.flush_cache()
    first = client.generate(prompt_token_ids=PROMPT, max_new_tokens=8, temperature=0, ignore_eos=True)
    second = client.generate(prompt_token_ids=PROMPT, max_new_tokens=8, temperature=0, ignore_eos=True)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == len(PROMPT) - 1  # the last prompt token is computed
    assert second.token_ids == first.token_ids
    # A continuation reuses the first turn, answer included.
    follow_up = PROMPT + first.token_ids + [40, 41]
    third = client.generate(prompt_token_ids=follow_up, max_new_tokens=4, temperature=0)
    assert third.usage.cached_tokens >= len(PROMPT) + len(first.token_ids) - 1
    load = client.server_load()
    assert load.kv_cached_tokens >= len(follow_up) - 1 and load.kv_used_tokens == 0
    assert 0 < load.prefix_cache_hit_rate < 1
    assert wait_until(lambda: _metric(server, "specserve_prompt_cached_tokens_total")
               >= second.usage.cached_tokens + third.usage.cached_tokens)
    assert _metric(server, "specserve_kv_cached_tokens") > 0


def test_flush_cache_empties_it(server, client):
    client.generate(prompt_token_ids=PROMPT, max_new_tokens=2, temperature=0)
    assert client.server_load().kv_cached_tokens > 0
    assert client.flush_cache() == 0  # idle: nothing is pinned
    assert client.server_load().kv_cached_tokens == 0
    again = client.generate(prompt_token_ids=PROMPT, max_new_tokens=2, temperature=0)
    assert again.usage.cached_tokens == 0
    assert engine_is_idle(client)


def test_flush_cache_refuses_a_malformed_request(server):
    import grpc

    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary("/specserve.v1.GenerationService/FlushCache",
                                   request_serializer=lambda b: b,
                                   response_deserializer=pb.FlushCacheResponse.FromString)
        with pytest.raises(grpc.RpcError) as error:
            call(b"\xff\xff\xff", timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_openai_usage_reports_cached_prompt_tokens(server, model):
    body = {"model": os.path.basename(model), "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    with httpx.Client(base_url=server.http_url + "/v1", timeout=30) as http:
        http.post("/completions", json=body).raise_for_status()
        usage = http.post("/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == len(PROMPT)
    assert usage["prompt_tokens_details"] == {"cached_tokens": len(PROMPT) - 1}


def test_disable_prefix_cache(model):
    server = ServerProcess(model, "--disable-prefix-cache")
    try:
        with server.client() as client:
            results = [client.generate(prompt_token_ids=PROMPT, max_new_tokens=4, temperature=0)
                       for _ in range(2)]
            assert [r.usage.cached_tokens for r in results] == [0, 0]
            assert results[0].token_ids == results[1].token_ids
            load = client.server_load()
            assert load.kv_cached_tokens == 0 and load.prefix_cache_hit_rate == 0
            assert client.flush_cache() == 0
    finally:
        assert server.stop() == 0
