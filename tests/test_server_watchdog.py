"""The engine watchdog: a frozen engine (SIGSTOP) turns health NOT_SERVING and ends the calls in
flight with UNAVAILABLE; a stuck main loop trips the stall timeout; the engine's heartbeat thread
beats on during a long step and carries the loop's progress (and stops once a tp rank died); a
dead tp rank fails the engine."""
from __future__ import annotations

import contextlib
import os
import signal

import pytest
import torch
import zmq

from helpers import process_exited
from server_harness import ServerProcess, free_port, http_get, wait_until
from specserve.clients import Unavailable
from specserve.engine.process import HeartbeatThread, ServerLink
from specserve.proto import engine_ipc_pb2 as ipc
from specserve.server.ops.health import GENERATION_SERVICE
from specserve.server.ops.watchdog import EngineWatchdog, WatchdogState

HEARTBEAT_TIMEOUT_S = 1.0


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watchdog(stall_timeout_s=30.0) -> tuple[EngineWatchdog, _Clock]:
    clock = _Clock()
    return EngineWatchdog(4.0, stall_timeout_s, clock=clock), clock


def test_not_watched_until_armed():
    watchdog, clock = _watchdog()
    clock.now += 1000
    assert watchdog.check() is None and watchdog.state is WatchdogState.STARTING


def test_missing_heartbeats_trip_the_heartbeat_timeout_once():
    watchdog, clock = _watchdog()
    watchdog.arm()
    for iteration in range(10):  # beating and progressing: fine however long it goes on
        clock.now += 3.9
        watchdog.on_heartbeat(iteration)
        assert watchdog.check() is None
    clock.now += 4.1
    reason = watchdog.check()
    assert reason.startswith("engine process unresponsive: no heartbeat for 4.1 s")
    assert "engine_heartbeat_timeout_s=4" in reason
    assert watchdog.state is WatchdogState.UNRESPONSIVE
    assert watchdog.check() is None  # reported once


def test_a_loop_that_stops_moving_trips_the_stall_timeout():
    watchdog, clock = _watchdog(stall_timeout_s=30.0)
    watchdog.arm()
    watchdog.on_heartbeat(7)
    for _ in range(29):  # a long step: heartbeats go on, the loop count does not move
        clock.now += 1.0
        watchdog.on_heartbeat(7)
        assert watchdog.check() is None
    assert watchdog.report().loop_stall_s == pytest.approx(29.0)
    clock.now += 1.5
    watchdog.on_heartbeat(7)
    assert watchdog.check().startswith("engine stalled: its loop has not finished a step for 30.5 s")
    assert watchdog.state is WatchdogState.STALLED


def test_the_stall_timeout_can_be_off():
    watchdog, clock = _watchdog(stall_timeout_s=None)
    watchdog.arm()
    for _ in range(100):
        clock.now += 1.0
        watchdog.on_heartbeat(0)
        assert watchdog.check() is None


def test_serve_flags_set_the_watchdog_timeouts():
    from specserve.cli import _server_config_from_args, build_parser

    def config(*flags: str):
        return _server_config_from_args(build_parser().parse_args(["serve", *flags]))

    assert (config().engine_heartbeat_timeout_s, config().engine_stall_timeout_s) == (4.0, 300.0)
    tuned = config("--engine-heartbeat-timeout", "1.5", "--engine-stall-timeout", "0")
    assert (tuned.engine_heartbeat_timeout_s, tuned.engine_stall_timeout_s) == (1.5, None)


def test_heartbeat_thread_reports_the_loop_count():
    """The engine-side heartbeat thread beats while the main loop stands still, and each beat
    carries the loop's current iteration count; it stops once a tensor-parallel rank died, and
    ends the process when the loop is still stuck (in a collective with the dead rank) after
    the grace."""
    class Ranks:
        failure = None

        def rank_failure(self):
            return self.failure

    class StuckLoop:
        iterations = 5
        engine = Ranks()

    context = zmq.Context()
    beats = context.socket(zmq.PULL)
    beats.setsockopt(zmq.LINGER, 0)
    port = beats.bind_to_random_port("tcp://127.0.0.1")
    link = ServerLink("unused", "unused", f"tcp://127.0.0.1:{port}", heartbeat_interval_s=0.01)
    exits = []
    heartbeat = HeartbeatThread(context, link, StuckLoop(), exit_grace_s=0.05, exit_process=exits.append)
    heartbeat.start()
    try:
        beats.setsockopt(zmq.RCVTIMEO, 10_000)
        received = [ipc.Heartbeat.FromString(beats.recv()).loop_iterations for _ in range(3)]
        StuckLoop.iterations = 6
        while ipc.Heartbeat.FromString(beats.recv()).loop_iterations != 6:
            pass
        # A dead tp rank: the beats stop (the loop may be stuck in a collective for good).
        StuckLoop.engine.failure = "tp_size: rank 1 (pid 7) died; the engine cannot go on"
        heartbeat.join(10)
        assert not heartbeat.is_alive()
    finally:
        heartbeat.stop()
        beats.close()
        context.term()
    assert received == [5, 5, 5]
    assert exits == [1]


def test_frozen_engine_goes_not_serving_and_fails_calls(tiny_model):
    metrics_port = free_port()
    server = ServerProcess(tiny_model, "--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                           "--metrics-port", str(metrics_port))
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    try:
        with server.client() as client:
            assert http_get(f"{metrics_url}/health") == (200, "SERVING\n")
            assert ('specserve_engine_watchdog{specserve_engine_watchdog="ok"} 1.0'
                    in http_get(f"{metrics_url}/metrics")[1])
            stream = iter(client.generate_stream("def add", max_new_tokens=500, ignore_eos=True,
                                                 timeout=120))
            next(stream)
            os.kill(server.engine_pid, signal.SIGSTOP)
            # The stream ends with UNAVAILABLE (not at its deadline), saying why.
            with pytest.raises(Unavailable, match="engine process unresponsive: no heartbeat"):
                for _ in stream:
                    pass
            assert client.health() == "NOT_SERVING"
            assert client.health(GENERATION_SERVICE) == "NOT_SERVING"
            assert http_get(f"{metrics_url}/health") == (503, "NOT_SERVING\n")
            assert ('specserve_engine_watchdog{specserve_engine_watchdog="unresponsive"} 1.0'
                    in http_get(f"{metrics_url}/metrics")[1])
            with pytest.raises(Unavailable):
                client.generate("hi", max_new_tokens=2)
        server.wait_for_log(r"killing the engine process")
        # The frozen engine is killed (a stopped process still dies of SIGKILL).
        assert wait_until(lambda: not os.path.exists(f"/proc/{server.engine_pid}"), 10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.engine_pid, signal.SIGCONT)
        assert server.stop() == 0



def _spawned_children(pid: int) -> list[int]:
    """The processes `pid` spawned with multiprocessing (tp followers; not its forkserver)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if ppid == pid and b"spawn_main" in f.read():
                    found.append(int(entry))
    return found


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_dead_tp_rank_fails_the_engine(tiny_model, device):
    """tp=2: rank 1 SIGKILLed mid-stream ends the stream with UNAVAILABLE saying which rank
    died, and health goes NOT_SERVING (not a frozen engine). On the CPU (gloo) the step's
    collective with the dead rank fails at once; on GPUs an NCCL collective may wait for it
    for good, and then the heartbeats stop (the server's heartbeat timeout)."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    metrics_port = free_port()
    server = ServerProcess(tiny_model, "--tp", "2", "--device", device, "--metrics-port", str(metrics_port))
    try:
        (follower,) = _spawned_children(server.engine_pid)
        with server.client() as client:
            stream = iter(client.generate_stream("def add", max_new_tokens=500, ignore_eos=True,
                                                 timeout=120))
            next(stream)
            os.kill(follower, signal.SIGKILL)
            died = r"tp_size: rank 1 \(pid \d+\) died" if device == "cpu" else r"died|no heartbeat"
            with pytest.raises(Unavailable, match=died):
                for _ in stream:
                    pass
            assert client.health() == "NOT_SERVING"
            assert http_get(f"http://127.0.0.1:{metrics_port}/health") == (503, "NOT_SERVING\n")
            with pytest.raises(Unavailable):
                client.generate("hi", max_new_tokens=2)
        # The engine process exits (its parent, the server, reaps it at its own exit).
        assert wait_until(lambda: process_exited(server.engine_pid), 60)
    finally:
        assert server.stop() == 0
