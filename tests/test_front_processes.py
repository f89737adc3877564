"""--front-processes: N front processes serve one port (SO_REUSEPORT) over replicas that the
supervising parent starts once (server/cluster/front_processes.py, front_link.py).

On test_cluster.py's local three-node Ray cluster: two fronts over two replicas of the demo
pair give one engine's greedy tokens to many concurrent streams on many connections, and both
fronts serve some of them; a prefix sent through one front lands, through the other, on the
replica that cached it (the engines' KV events reach every front); bad input is refused naming
the field on every front; no KV is left on any replica. A killed front stops the whole server
(exit 1, replicas and the other front gone), as documented.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import pytest

import zmq

from helpers import process_exited
from server_harness import ServerProcess, free_port, metric_samples, wait_until
from specserve import cli
from specserve.clients.messages import chunk_from_proto, results_from_chunks
from specserve.engine.config import SamplingParams
from specserve.engine.outputs import EngineLoad, StepOutput, StepStat
from specserve.engine.process import _EngineLoop
from specserve.engine.wire import add_request_to_proto, decode_batch, decode_step_stats
from specserve.proto import engine_ipc_pb2 as ipc
from specserve.proto import generate_pb2 as pb
from specserve.proto import generate_pb2_grpc as pb_grpc
from specserve.server.cluster.config import ClusterConfig
from specserve.server.cluster.front_processes import front_server_config
from specserve.server.config import ServerConfig
from test_cluster import (DEMO_TARGET, GREEDY, _idle, ray_cluster,  # noqa: F401 (fixtures)
                          single_engine_outputs)

FRONTS = 2


# --- configuration ---------------------------------------------------------------------------
def test_front_processes_flag_and_its_errors_name_the_field():
    pytest.importorskip("ray")
    args = cli.build_parser().parse_args(["serve", "--data-parallel", "2", "--front-processes", "3"])
    assert cli._cluster_config_from_args(args).front_processes == 3
    args = cli.build_parser().parse_args(["serve", "--data-parallel", "2"])
    assert cli._cluster_config_from_args(args).front_processes == 1
    for value in (0, -1, 1.5):
        with pytest.raises(ValueError, match="^front_processes"):
            ClusterConfig(front_processes=value)
    with pytest.raises(SystemExit):  # a usage error at the command line
        cli.main(["serve", "--data-parallel", "2", "--front-processes", "0"])


def test_each_front_serves_metrics_at_the_port_plus_its_index():
    config = ServerConfig(metrics_port=9400)
    assert [front_server_config(config, i).metrics_port for i in range(3)] == [9400, 9401, 9402]
    assert front_server_config(ServerConfig(metrics_port=0), 2).metrics_port == 0  # free ports
    assert front_server_config(ServerConfig(), 2).metrics_port is None
    with pytest.raises(ValueError, match=r"^metrics_port: .*front process 2"):
        front_server_config(ServerConfig(metrics_port=65534), 2)


# --- one engine, several links (engine/process.py) -----------------------------------------------
class _CountingEngine:
    """Stands in for Engine in the engine loop: each running request gets one token a step."""

    def __init__(self):
        self.running: dict[str, int] = {}  # rid -> tokens still to come
        self.aborted: list[str] = []

    def add_request(self, rid, prompt_token_ids, sampling):
        self.running[rid] = sampling.max_new_tokens

    def abort(self, rid, index=None):
        self.aborted.append(rid)
        self.running.pop(rid, None)

    def has_unfinished(self):
        return bool(self.running)

    def step(self):
        time.sleep(0.002)
        outputs = []
        for rid in list(self.running):
            self.running[rid] -= 1
            finished = self.running[rid] == 0
            if finished:
                del self.running[rid]
            outputs.append(StepOutput(rid=rid, new_token_ids=[7], finished=finished,
                                      finish_reason="length" if finished else None))
        return outputs

    def take_step_stats(self):
        return [StepStat(False, 0.001, len(self.running), 0)]

    def load(self):
        return EngineLoad(len(self.running), 0, 0, 1, 1.0, 0)

    def check_ranks(self):
        pass

    def grammar_health(self):
        return None

    def flush_prefix_cache(self):
        pass


def _messages(sock: zmq.Socket, until, timeout_s: float = 10.0) -> list:
    """EngineToServer messages from `sock` until `until(messages)` holds."""
    messages = []
    deadline = time.monotonic() + timeout_s
    while not until(messages):
        assert sock.poll(max(1, int(1000 * (deadline - time.monotonic())))), messages
        messages.append(ipc.EngineToServer.FromString(sock.recv()))
    return messages


def test_an_engine_serves_each_link_its_own_outputs_and_every_link_the_steps():
    """Two servers' links into one engine loop: a request's outputs go back on the link it came
    on, every link gets every step's StepStats; a link's Shutdown aborts what it still runs
    (its KV freed) while the other goes on; the loop ends when both have shut down."""
    context = zmq.Context()
    to_engine, from_engine, requests, outputs = [], [], [], []
    for link in range(2):
        to_engine.append(context.socket(zmq.PUSH))
        to_engine[-1].bind(f"inproc://requests-{link}")
        from_engine.append(context.socket(zmq.PULL))
        from_engine[-1].bind(f"inproc://outputs-{link}")
        requests.append(context.socket(zmq.PULL))
        requests[-1].connect(f"inproc://requests-{link}")
        outputs.append(context.socket(zmq.PUSH))
        outputs[-1].connect(f"inproc://outputs-{link}")
    engine = _CountingEngine()
    loop = _EngineLoop(engine, requests, outputs, os.getppid())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()

    def add(link: int, rid: str, tokens: int) -> None:
        to_engine[link].send(ipc.ServerToEngine(add=add_request_to_proto(
            rid, [1, 2, 3], SamplingParams(max_new_tokens=tokens))).SerializeToString())

    def batches(messages) -> list:
        return [m.batch for m in messages if m.WhichOneof("kind") == "batch"]

    def finished(rid):
        return lambda messages: any(out.rid == rid and out.finished for b in batches(messages)
                                    for out in decode_batch(b))

    add(1, "long", 10_000)
    add(0, "short", 3)
    on_0 = _messages(from_engine[0], finished("short"))
    assert {out.rid for b in batches(on_0) for out in decode_batch(b)} == {"short"}
    assert sum(len(decode_step_stats(b)) for b in batches(on_0)) >= 3  # every step, here too
    on_1 = _messages(from_engine[1], lambda ms: sum(len(decode_batch(b)) for b in batches(ms)) >= 3)
    assert {out.rid for b in batches(on_1) for out in decode_batch(b)} == {"long"}
    # A load query is answered on the link that asked.
    to_engine[1].send(ipc.ServerToEngine(load_query=ipc.LoadQuery(query_id=5)).SerializeToString())
    assert any(m.WhichOneof("kind") == "load" and m.load.query_id == 5
               for m in _messages(from_engine[1], lambda ms: any(m.WhichOneof("kind") == "load"
                                                                 for m in ms)))
    to_engine[1].send(ipc.ServerToEngine(shutdown=ipc.Shutdown()).SerializeToString())
    assert wait_until(lambda: engine.aborted == ["long"] and not loop.live)
    assert thread.is_alive()  # link 0 is still open
    add(0, "after", 2)
    _messages(from_engine[0], finished("after"))
    to_engine[0].send(ipc.ServerToEngine(shutdown=ipc.Shutdown()).SerializeToString())
    thread.join(10)
    assert not thread.is_alive()
    for sock in to_engine + from_engine + requests + outputs:
        sock.close(linger=0)
    context.term()



class Connection:
    """A gRPC channel with a TCP connection of its own (no subchannel shared with the other
    channels of this process), so the kernel picks its front afresh."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    def server_load(self) -> pb.ServerLoad:
        return self.stub.GetServerLoad(pb.GetServerLoadRequest(), timeout=10)

    def generate(self, token_ids: list[int], **sampling):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=token_ids),
                                     sampling=pb.SamplingParams(**sampling))
        chunks = (chunk_from_proto(c) for c in self.stub.Generate(request, timeout=60))
        [result] = results_from_chunks(chunks)
        return result

    def close(self) -> None:
        self.channel.close()


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def fronts_server(ray_cluster, metrics_port):  # noqa: F811 (the imported fixture)
    server = ServerProcess(DEMO_TARGET, "--ray-address", ray_cluster.address,
                           "--data-parallel", "2", "--front-processes", str(FRONTS),
                           "--metrics-port", str(metrics_port), "--http-port", "0",
                           "--engine-heartbeat-timeout", "2",
                           "--log-level", "DEBUG",  # the routing decisions
                           speculative=True)
    yield server
    assert server.stop() == 0, "\n".join(server.log[-30:])


def _served(metrics_port: int) -> list[float]:
    """Generate calls each front has answered (its own /metrics at --metrics-port + i)."""
    counts = []
    for front in range(FRONTS):
        samples = metric_samples(f"http://127.0.0.1:{metrics_port + front}/metrics")
        counts.append(sum(v for (name, _), v in samples.items()
                          if name == "specserve_requests_total"))
    return counts


def _front_of(connection: Connection, metrics_port: int) -> int:
    """Which front serves this connection: the one whose count a call through it moves."""
    before = _served(metrics_port)
    connection.generate([3, 4, 5], max_new_tokens=1)
    moved = [i for i, (a, b) in enumerate(zip(before, _served(metrics_port))) if b > a]
    assert len(moved) == 1, (before, moved)
    return moved[0]


def test_health_says_serving_only_after_every_front_is_ready(fronts_server):
    """The parent says AllReady once every front reported ready; each front turns SERVING only
    then (the parent's line is written before it tells them)."""
    log = fronts_server.log
    fronts_server.wait_for_log(r"front-1 .*SERVING")
    fronts_server.wait_for_log(r"front-0 .*SERVING")
    all_ready = next(i for i, line in enumerate(log) if f"all {FRONTS} front processes ready" in line)
    for front in range(FRONTS):
        serving = next(i for i, line in enumerate(log)
                       if re.search(rf"front-{front} .*engine ready: .*SERVING", line))
        assert all_ready < serving
    # One engine per replica, started once by the parent, whatever the number of fronts.
    assert len(re.findall(r"engine process started \(replica", "\n".join(log))) == 2


def test_many_streams_through_both_fronts_equal_one_engine(fronts_server, metrics_port,
                                                           single_engine_outputs):
    prompts, expected = single_engine_outputs
    before = _served(metrics_port)
    connections = [Connection(fronts_server.address) for _ in range(16)]
    jobs = [(c, i % len(prompts)) for c in connections for i in range(2)]
    results = [None] * len(jobs)

    def one(j):
        connection, p = jobs[j]
        results[j] = connection.generate(prompts[p], **GREEDY).token_ids

    threads = [threading.Thread(target=one, args=(j,)) for j in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for connection in connections:
        connection.close()
    assert results == [expected[p] for _, p in jobs]
    after = _served(metrics_port)
    served = [b - a for a, b in zip(before, after)]
    assert sum(served) == len(jobs) and all(s > 0 for s in served), served  # both fronts served
    with fronts_server.client() as client:
        assert wait_until(lambda: _idle(client), timeout=20)


def test_a_prefix_sent_through_another_front_lands_on_its_replica(fronts_server, metrics_port):
    """Front 1 never routed these prefixes itself: it sends them where front 0's calls cached
    them because it reads every engine's KV-cache events (its log says "affinity"; without the
    events it would route by load, "least_loaded")."""
    connections = _connection_per_front(fronts_server, metrics_port)
    for n in range(4):
        system = [(13 * i + 29 * n) % 500 + 3 for i in range(48)]  # 3 whole 16-token blocks
        assert connections[0].generate(system + [7], **GREEDY).usage.cached_tokens < 16  # new
        time.sleep(1.0)  # the events: published by the prefill, long before the call ended
        mark = len(fronts_server.log)
        again = connections[1].generate(system + [8, 9], **GREEDY)
        assert again.usage.cached_tokens >= 48

        def routed() -> list[tuple[str, str]]:
            return [m for line in fronts_server.log[mark:] if " front-1 " in line
                    for m in re.findall(r"-> replica \d \((\w+), (\d+) tokens expected cached\)",
                                        line)]

        assert wait_until(lambda: routed() == [("affinity", "48")]), routed()
    for connection in connections.values():
        connection.close()
    with fronts_server.client() as client:
        assert wait_until(lambda: _idle(client), timeout=20)


def test_bad_input_is_refused_naming_the_field_on_every_front(fronts_server, metrics_port):
    seen = set()
    while len(seen) < FRONTS:
        connection = Connection(fronts_server.address)
        seen.add(_front_of(connection, metrics_port))
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_logprobs=3))
        with pytest.raises(grpc.RpcError) as info:
            list(connection.stub.Generate(request, timeout=30))
        connection.close()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("top_logprobs:"), info.value.details()


def _connection_per_front(server: ServerProcess, metrics_port: int) -> dict[int, Connection]:
    connections = {}
    while len(connections) < FRONTS:  # each new connection's front is the kernel's choice
        connection = Connection(server.address)
        front = _front_of(connection, metrics_port)
        if front in connections:
            connection.close()
        else:
            connections[front] = connection
    return connections


def test_the_http_front_shares_the_port_too(fronts_server, metrics_port, single_engine_outputs):
    """Each request a new HTTP connection: the kernel gives both fronts some."""
    prompts, _ = single_engine_outputs
    before = _served(metrics_port)
    for i in range(16):
        request = urllib.request.Request(
            f"{fronts_server.http_url}/v1/completions", method="POST",
            headers={"Content-Type": "application/json", "Connection": "close"},
            data=json.dumps({"model": "demo-target", "prompt": prompts[i % 2], "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            body = json.loads(response.read())
        assert body["usage"]["completion_tokens"] == 8
    served = [b - a for a, b in zip(before, _served(metrics_port))]
    assert sum(served) == 16 and all(n > 0 for n in served), served


def test_a_frozen_replica_is_killed_through_the_parent_and_comes_back_for_every_front(
        fronts_server, metrics_port):
    """SIGSTOP on replica 1's engine: the fronts' watchdogs ask the parent to kill it, every
    front sees it go and restarts it, and the parent starts one new engine once both have
    reattached; replica 0 serves throughout, and each front sees replica 1 back (1 restart)."""
    connections = _connection_per_front(fronts_server, metrics_port)
    pids = [int(m) for m in re.findall(r"engine process started \(replica 1: pid (\d+)",
                                       "\n".join(fronts_server.log))]
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGSTOP)
    fronts_server.wait_for_log(r"a front's watchdog asks to kill its engine", timeout=30)
    for front in range(FRONTS):
        fronts_server.wait_for_log(rf"front-{front} .*replica 1 left routing", timeout=30)
    assert connections[0].generate([9, 8, 7], max_new_tokens=3).usage.completion_tokens == 3

    def back(connection: Connection) -> bool:
        rows = connection.server_load().replicas
        return rows[1].restarts == 1 and all(
            row.serving and row.num_running == row.kv_used_tokens == 0 for row in rows)

    assert wait_until(lambda: all(back(c) for c in connections.values()), timeout=120,
                      interval=0.5)
    started = re.findall(r"engine process started \(replica 1: pid (\d+)", "\n".join(fronts_server.log))
    assert len(started) == 2 and process_exited(pids[0])  # one new engine, the old one gone
    for connection in connections.values():
        connection.close()


def test_a_killed_front_stops_the_server_loudly(ray_cluster):  # noqa: F811
    """SIGKILL on one front: the parent stops the other front and the replica's engine, and
    exits 1 with an error line naming the front."""
    server = ServerProcess(DEMO_TARGET, "--ray-address", ray_cluster.address,
                           "--data-parallel", "1", "--front-processes", str(FRONTS))
    try:
        pids = [int(p) for p in server.wait_for_log(
            r"front processes \(pids (\d+(?:, \d+)*)\)").group(1).split(", ")]
        with server.client() as client:
            assert client.generate("hello", max_new_tokens=2).usage.completion_tokens == 2
        os.kill(pids[1], signal.SIGKILL)
        assert server.process.wait(120) == 1, "\n".join(server.log[-30:])
        server.wait_for_log(rf"ERROR front process 1 \(pid {pids[1]}\) exited with code -9; "
                            rf"stopping the server")
        assert wait_until(lambda: process_exited(pids[0]) and process_exited(server.engine_pid),
                          timeout=30)
    finally:
        server.stop()


def test_fronts_end_when_their_parent_dies(ray_cluster):  # noqa: F811
    """SIGKILL on the supervising parent (no drain): each front notices its parent gone and
    stops, and the replica's engine goes with the parent's Ray driver."""
    server = ServerProcess(DEMO_TARGET, "--ray-address", ray_cluster.address,
                           "--data-parallel", "1", "--front-processes", str(FRONTS))
    try:
        pids = [int(p) for p in server.wait_for_log(
            r"front processes \(pids (\d+(?:, \d+)*)\)").group(1).split(", ")]
        server.process.kill()
        server.process.wait(30)
        for front in range(FRONTS):
            server.wait_for_log(rf"front-{front} .*the parent process \d+ is gone; stopping",
                                timeout=30)
        assert wait_until(lambda: all(process_exited(p) for p in pids)
                          and process_exited(server.engine_pid), timeout=60)
    finally:
        server.stop()
