"""Operator metrics and the access log through a real speculative server: /metrics parsed with
prometheus_client's parser after a few calls, and one access-log line per call."""
from __future__ import annotations

import re

import pytest

from helpers import make_predictable_pair
from server_harness import (TTFT_STAGE_NAMES, ServerProcess, assert_complete_ttft_stages,
                            free_port, metric_samples, ttft_stages)
from specserve.clients import InvalidArgument

MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target, head = make_predictable_pair(str(tmp_path_factory.mktemp("pair")))
    metrics_port = free_port()
    server = ServerProcess(target, "--draft-model", head, "--speculative-algorithm", "eagle",
                           "--speculative-num-steps", "3", "--metrics-port", str(metrics_port),
                           speculative=True)
    server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def results(server):
    """Two finished calls (one cut by a stop token id) and one refused."""
    with server.client() as client:
        finished = [client.generate("def add(a, b):", max_new_tokens=MAX_NEW_TOKENS,
                                    temperature=0, ignore_eos=True)]
        stop_id = finished[0].token_ids[3]
        finished.append(client.generate("def add(a, b):", max_new_tokens=MAX_NEW_TOKENS,
                                        temperature=0, stop_token_ids=[stop_id]))
        with pytest.raises(InvalidArgument):
            client.generate("def add(a, b):", max_new_tokens=10**6)
    return finished


def _samples(server) -> dict[tuple[str, tuple], float]:
    return metric_samples(server.metrics_url)


def test_metrics_after_a_few_calls(server, results):
    samples = _samples(server)
    assert samples[("specserve_requests_total", (("code", "OK"),))] == 2
    assert samples[("specserve_requests_total", (("code", "INVALID_ARGUMENT"),))] == 1
    assert samples[("specserve_finished_requests_total", (("finish_reason", "length"),))] == 1
    assert samples[("specserve_finished_requests_total", (("finish_reason", "stop"),))] == 1
    assert samples[("specserve_prompt_tokens_total", ())] == sum(r.usage.prompt_tokens
                                                                 for r in results)
    assert samples[("specserve_generated_tokens_total", ())] == sum(r.usage.completion_tokens
                                                                    for r in results)
    assert samples[("specserve_spec_verify_steps_total", ())] == sum(r.spec.verify_steps
                                                                     for r in results)
    assert samples[("specserve_spec_accepted_draft_tokens_total", ())] == sum(
        r.spec.accepted_drafts for r in results) > 0
    eagle = (("method", "eagle"),)
    assert samples[("specserve_spec_method_verify_steps_total", eagle)] == sum(r.spec.verify_steps for r in results)
    assert samples[("specserve_spec_method_accepted_draft_tokens_total", eagle)] == sum(
        r.spec.accepted_drafts for r in results)
    assert samples[("specserve_spec_draft_depth", eagle)] == 3
    for histogram in ("queue_time", "time_to_first_token", "time_per_output_token"):
        # One observation per call the engine ran (the refused one never reached it).
        assert samples[(f"specserve_{histogram}_seconds_count", ())] == 2, histogram
    # Between chunks: every chunk after each call's first one.
    assert samples[("specserve_inter_token_latency_seconds_count", ())] >= 2
    assert samples[("specserve_inter_token_latency_seconds_sum", ())] > 0
    assert samples[("process_resident_memory_bytes", ())] > 0
    # Where TTFT went: every stage observed once per call that got a token.
    for stage in TTFT_STAGE_NAMES:
        assert samples[("specserve_ttft_stage_seconds_count", (("stage", stage),))] == 2, stage
    stage_sum = sum(samples[("specserve_ttft_stage_seconds_sum", (("stage", stage),))]
                    for stage in TTFT_STAGE_NAMES)
    ttft_sum = samples[("specserve_time_to_first_token_seconds_sum", ())]
    assert ttft_sum - 0.01 <= stage_sum  # the stages reach past the first token (its write)
    # The engine's steps: each call's prefill, then decode steps; single calls decode alone.
    assert samples[("specserve_engine_step_seconds_count", (("mode", "extend"),))] >= 2
    assert samples[("specserve_engine_step_seconds_count", (("mode", "decode"),))] >= 2
    assert samples[("specserve_engine_step_seconds_sum", (("mode", "decode"),))] > 0
    # (the second call's prompt is the first's: the prefix cache has all but its last token)
    assert samples[("specserve_engine_extend_tokens_sum", ())] >= results[0].usage.prompt_tokens + 1
    assert samples[("specserve_engine_decode_stall_seconds_count", ())] == 0


def test_one_access_log_line_per_call(server, results):
    server.wait_for_log(r"request \w+ status=INVALID_ARGUMENT")
    lines = [line for line in server.log if re.search(r"request \w+ status=", line)]
    assert len(lines) == 3
    pattern = re.compile(
        r"request (\w+) status=(\w+) finish_reason=(\S+) prompt_tokens=(\d+) cached_tokens=(\d+) "
        r"completion_tokens=(\d+) ttft=(\S+) duration=(\S+) accept_length=(\S+) "
        r"ttft_stages_ms=(\S+)$")
    parsed = [pattern.search(line) for line in lines]
    assert all(parsed), lines
    for match, result in zip(parsed, results):
        rid, status, reason, prompt, cached, completion, ttft, duration, accept, _ = match.groups()
        assert (status, reason) == ("OK", result.finish_reason)
        assert (int(prompt), int(cached), int(completion)) == (
            result.usage.prompt_tokens, result.usage.cached_tokens, result.usage.completion_tokens)
        assert 0 < float(ttft.rstrip("s")) <= float(duration.rstrip("s"))
        assert float(accept) == pytest.approx(result.spec.accept_length, abs=0.005)
        assert_complete_ttft_stages(match.group(0))
        # The server's TTFT ends where the stage "to_consumer" does.
        stages = ttft_stages(match.group(0))
        assert sum(stages.values()) - stages["write"] == pytest.approx(
            1000 * float(ttft.rstrip("s")), abs=1.0)
    refused = parsed[2].groups()
    assert refused[1:5] == ("INVALID_ARGUMENT", "-", "0", "0") and refused[6] == "-"
    assert ttft_stages(parsed[2].group(0)) == {}
    assert len({match.group(1) for match in parsed}) == 3  # one request id each


def test_progress_and_throughput_lines(tiny_model):
    """Start-up says what it loads and builds; a busy server logs throughput, queue and KV."""
    server = ServerProcess(tiny_model, "--stats-log-interval", "0.2")
    try:
        for pattern in (r"loading .*LlamaForCausalLM, 2 layers", r"KV pool: \d+ slots", r"warming up"):
            server.wait_for_log(pattern, timeout=5)
        with server.client() as client:
            for _ in range(3):
                client.generate("def add(a, b):", max_new_tokens=300, ignore_eos=True)
        line = server.wait_for_log(r"throughput ([\d.]+) tokens/s; \d+ running, \d+ waiting; "
                                   r"KV \d+/\d+ \(\d+%\)", timeout=10)
        assert float(line.group(1)) > 0
    finally:
        assert server.stop() == 0


def test_load_gauges_are_one_step_fresh(server, results):
    """The running / waiting / KV gauges gateways route by come with every engine step (not a
    poll every 2 s): right after a stream's first chunk its request runs and holds KV; right
    after its last, nothing does. The usage ratio is used / total, in [0, 1]."""
    def load() -> tuple[float, float, float, float]:
        s = _samples(server)
        return (s[("specserve_engine_running_requests", ())],
                s[("specserve_engine_waiting_requests", ())],
                s[("specserve_kv_used_tokens", ())] / s[("specserve_kv_total_tokens", ())],
                s[("specserve_kv_cache_usage_ratio", ())])

    with server.client() as client:
        for round_ in range(3):
            chunks = iter(client.generate_stream(f"class Queue{round_}:", max_new_tokens=200,
                                                 temperature=0, ignore_eos=True))
            next(chunks)
            during = load()
            for _ in chunks:
                pass
            after = load()
            assert during[:2] == (1, 0) and 0 < during[3] <= 1, during
            assert during[3] == pytest.approx(during[2]), during
            assert after == (0, 0, 0.0, 0.0), after
