"""The engine's grammar service through real servers (both loops): its state in the health
service and the metrics; SIGKILLed mid-run, the constrained requests it held fail with an
error the client sees (gRPC UNAVAILABLE; HTTP 503 with an OpenAI error body, or an SSE error
event before [DONE] once a stream started), never a 200 with "abort", and constrained requests
succeed again within seconds without a server restart; unconstrained ones never notice; heavy
schemas compiling do not hold up unconstrained requests; a stream that ran to its end counts
as OK."""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import threading
import time

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import ServerProcess, engine_is_idle, free_port, wait_until

from specserve.proto import generate_pb2 as pb
from specserve.proto import generate_pb2_grpc as pb_grpc

GRAMMAR = "specserve.grammar"
LONG = {"prompt": "x", "max_tokens": 300, "regex": "[ab]{2000}"}   # runs until the kill


@pytest.fixture(scope="module", params=["overlap", "normal"])
def server(request, tiny_model):
    args = ["--http-port", str(free_port())]
    if request.param == "normal":
        args.append("--disable-overlap")
    server = ServerProcess(tiny_model, *args)
    server.loop = request.param
    yield server
    assert server.stop() == 0


def _metric(server, name: str, **labels) -> float:
    body = httpx.get(server.http_url + "/metrics").text
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def _grammar_pid(server) -> int:
    """The grammar process now serving (the engine logs each start)."""
    return int(re.findall(r"grammar process started \(pid (\d+)\)", "\n".join(server.log))[-1])


def _constrained_ok(url: str) -> bool:
    got = httpx.post(url + "/v1/completions", timeout=60,
                     json={"prompt": "x", "max_tokens": 6, "regex": "[ab]{20}"})
    if got.status_code == 200:
        assert set(got.json()["choices"][0]["text"]) <= {"a", "b"}
        return True
    assert got.status_code == 503 and got.json()["error"]["type"] == "service_unavailable"
    return False


def test_grammar_service_serving_from_the_start(server, client):
    """Warmed before the server says SERVING: its health service and gauge say so at once."""
    assert client.health() == "SERVING" and client.health(GRAMMAR) == "SERVING"
    assert _metric(server, "specserve_grammar_up") == 1.0
    assert server.log.index(next(l for l in server.log if "grammar process started" in l)) < \
        server.log.index(next(l for l in server.log if re.search(r"; SERVING$", l)))


def test_stream_that_runs_to_its_end_counts_ok(server, client):
    ok, cancelled = (_metric(server, "specserve_requests_total", code=c) for c in ("OK", "CANCELLED"))
    with httpx.stream("POST", server.http_url + "/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 5, "stream": True, "n": 2}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    rid = response.headers["x-request-id"]
    line = server.wait_for_log(rf"request {rid} status=\S+ ").string
    assert "status=OK" in line and "finish_reason=length,length" in line
    assert _metric(server, "specserve_requests_total", code="OK") == ok + 1
    assert _metric(server, "specserve_requests_total", code="CANCELLED") == cancelled


def test_killed_grammar_process_fails_its_requests_visibly_then_restarts(server, client):
    url = server.http_url
    restarts = _metric(server, "specserve_grammar_restarts_total")
    unavailable = _metric(server, "specserve_requests_total", code="UNAVAILABLE")
    errors = _metric(server, "specserve_finished_requests_total", finish_reason="error")
    results: dict = {}

    def whole(name, body):
        results[name] = httpx.post(url + "/v1/completions", json=body, timeout=120)

    def free():  # unconstrained, running across the kill
        results["free"] = client.generate("x", max_new_tokens=200, ignore_eos=True)

    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        grpc_stream = stub.Generate(pb.GenerateRequest(
            text="x", sampling=pb.SamplingParams(max_new_tokens=300),
            structured_output=pb.StructuredOutput(regex="[ab]{2000}")))
        threads = [threading.Thread(target=whole, args=("whole", LONG)),
                   threading.Thread(target=whole, args=("n2", {**LONG, "n": 2}))]
        for t in threads:
            t.start()
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True},
                          timeout=120) as response:
            lines = response.iter_lines()
            first = [next(lines) for _ in range(2)]   # the stream has started (one event, "")
            assert first[0].startswith("data: {") and next(grpc_stream).token_ids
            # Every constrained sequence is running (5: the stream, gRPC, whole, n = 2), then
            # the free one (started last: it would finish first and never count with them).
            assert wait_until(lambda: client.server_load().num_running >= 5, 30)
            threads.append(threading.Thread(target=free))
            threads[-1].start()
            assert wait_until(lambda: client.server_load().num_running >= 6, 30)
            os.kill(_grammar_pid(server), signal.SIGKILL)
            events = first[:1] + [line for line in lines if line.startswith("data: ")]
        with pytest.raises(grpc.RpcError) as failed:
            list(grpc_stream)
        for t in threads:
            t.join(120)
    # The stream: its events, then an error event, then [DONE]; no finish_reason but OpenAI's.
    assert response.status_code == 200 and events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "503"
    assert "grammar service" in error["message"]
    for event in events[:-2]:
        assert all(c["finish_reason"] is None for c in json.loads(event[len("data: "):])["choices"])
    # Whole responses (n = 1 and 2): 503 and OpenAI's error body. gRPC: UNAVAILABLE.
    for name in ("whole", "n2"):
        assert results[name].status_code == 503, results[name].text
        body = results[name].json()["error"]
        assert body["type"] == "service_unavailable" and "grammar service" in body["message"]
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "grammar service" in failed.value.details()
    # The unconstrained request ran to its end.
    assert results["free"].finish_reason == "length" and len(results["free"].token_ids) == 200
    # Counted: each failed call by its code, each failed choice (n = 2: the one that ended it).
    n2 = results["n2"].headers["x-request-id"]
    assert re.search(r"finish_reason=(error,-|-,error|error,error) ",
                     server.wait_for_log(rf"request {n2} status=UNAVAILABLE ").string)
    assert _metric(server, "specserve_requests_total", code="UNAVAILABLE") == unavailable + 4
    assert _metric(server, "specserve_finished_requests_total", finish_reason="error") >= errors + 4
    # Back within seconds, without a server restart; nothing leaked.
    assert wait_until(lambda: _constrained_ok(url), 60, 0.2)
    assert wait_until(lambda: client.health(GRAMMAR) == "SERVING", 10)
    assert _metric(server, "specserve_grammar_restarts_total") == restarts + 1
    assert _metric(server, "specserve_grammar_up") == 1.0
    assert client.health() == "SERVING"
    assert wait_until(lambda: engine_is_idle(client), 10), client.server_load()


def _heavy_schema(tag: int) -> dict:
    """Small, shallow and valid, but its patterns take xgrammar 1-2 s to convert (their
    repetitions expand; 4x that on a loaded CI machine): the grammar process's work, within
    its budget."""
    pattern = {"type": "string", "pattern": "([a-z]{1,30}-){1,300}"}
    return {"type": "object", "properties": {f"p{tag}_{i}": pattern for i in range(10)}}


def _ttft(client) -> float:
    start = time.perf_counter()
    chunks = iter(client.generate_stream("x", max_new_tokens=4))
    next(chunks)
    elapsed = time.perf_counter() - start
    for _ in chunks:
        pass
    return elapsed


def test_heavy_schemas_do_not_hold_up_unconstrained_requests(server, client):
    """Three heavy schemas compiling (in the grammar process's niced threads, not the prepare
    path): an unconstrained request's time to first token stays near its baseline on the same
    server, and it ends long before they do."""
    if server.loop != "overlap":
        pytest.skip("the admission path is the same in both loops; one is enough")
    baseline = statistics.median(_ttft(client) for _ in range(5))
    done: dict = {}

    def heavy(tag):
        start = time.perf_counter()
        with grpc.insecure_channel(server.address) as channel:
            list(pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(
                text="x", sampling=pb.SamplingParams(max_new_tokens=2),
                structured_output=pb.StructuredOutput(json_schema=json.dumps(_heavy_schema(tag))))))
        done[tag] = time.perf_counter() - start

    started = time.perf_counter()
    threads = [threading.Thread(target=heavy, args=(tag,)) for tag in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # their preparation is done; they compile
    loaded = [_ttft(client) for _ in range(5)]
    measured = time.perf_counter() - started
    for t in threads:
        t.join(120)
    assert len(done) == 3 and not done.keys() - {0, 1, 2}
    assert min(done.values()) > measured, (done, measured)   # they were compiling all along
    # About the baseline (one step plus its own prefill), measured on the same server; on the
    # prepare path (before) it was the schemas' whole conversion, seconds: 100x and more.
    assert statistics.median(loaded) < 5 * baseline, (loaded, baseline)
