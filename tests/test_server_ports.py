"""A port that is already taken ends `specserve serve` at once: one clear error line, exit
status 1, no traceback, no engine started. In particular a second server cannot share the gRPC
port of a running one (gRPC's default SO_REUSEPORT would let it)."""
from __future__ import annotations

import socket
import subprocess

from server_harness import ServerProcess, serve_command

EXIT_TIMEOUT_S = 120.0


def _serve_and_exit(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(serve_command(*args, **kwargs), capture_output=True, text=True,
                          timeout=EXIT_TIMEOUT_S)


def _assert_one_line_error(result: subprocess.CompletedProcess, message: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert [line for line in output.splitlines() if message in line], output
    assert "Traceback" not in output and "engine process started" not in output, output


def test_second_server_on_the_same_port_exits_1(tiny_model):
    first = ServerProcess(tiny_model)
    try:
        second = _serve_and_exit(tiny_model, port=first.port)
        _assert_one_line_error(
            second, f"cannot listen on 127.0.0.1:{first.port} (--port): Address already in use")
        with first.client() as client:
            assert client.health() == "SERVING"
    finally:
        assert first.stop() == 0


def test_metrics_port_in_use_exits_1(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve_and_exit(tiny_model, "--metrics-port", str(port))
    _assert_one_line_error(
        result, f"cannot listen on 127.0.0.1:{port} (--metrics-port): Address already in use")
