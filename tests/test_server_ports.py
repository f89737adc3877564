"""A port that is already taken ends `specserve serve` at once: one clear error line, exit
status 1, no traceback, no engine started. In particular a second server cannot share the gRPC
port of a running one (gRPC's default SO_REUSEPORT would let it)."""
from __future__ import annotations

import socket

from server_harness import ServerProcess, assert_one_error_line, serve_and_exit


def test_second_server_on_the_same_port_exits_1(tiny_model):
    first = ServerProcess(tiny_model)
    try:
        second = serve_and_exit(tiny_model, port=first.port)
        assert_one_error_line(
            second, f"cannot listen on 127.0.0.1:{first.port} (--port): Address already in use")
        with first.client() as client:
            assert client.health() == "SERVING"
    finally:
        assert first.stop() == 0


def _taken_port() -> socket.socket:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


def test_metrics_port_in_use_exits_1(tiny_model):
    with _taken_port() as taken:
        port = taken.getsockname()[1]
        result = serve_and_exit(tiny_model, "--metrics-port", str(port))
    assert_one_error_line(
        result, f"cannot listen on 127.0.0.1:{port} (--metrics-port): Address already in use")


def test_http_port_in_use_exits_1(tiny_model):
    """Its one line only: the gRPC server (bound by then) used to outlive the event loop, kept
    by FastAPI's caches through the app, and printed a garbled "Error in sys.excepthook"."""
    with _taken_port() as taken:
        port = taken.getsockname()[1]
        result = serve_and_exit(tiny_model, "--http-port", str(port))
    assert_one_error_line(
        result, f"cannot listen on 127.0.0.1:{port} (--http-port): Address already in use")
