"""The --metrics-port side port is bounded like the HTTP front ([E27]): a silent client is cut
off after the read timeout, connections past the cap are closed at once, and /health answers
again as soon as the held connections are gone. In process, no model."""
from __future__ import annotations

import socket
import time

import pytest
from prometheus_client import CollectorRegistry

from server_harness import http_get
from specserve.server.ops.http_endpoint import HttpEndpoint

TIMEOUT_S = 0.5


@pytest.fixture
def endpoint():
    endpoint = HttpEndpoint(CollectorRegistry(), lambda: True, max_connections=2,
                            read_timeout_s=TIMEOUT_S)
    port = endpoint.start("127.0.0.1", 0)
    yield port
    endpoint.stop()


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes `sock` (recv returns b"")."""
    start = time.monotonic()
    sock.settimeout(10 * TIMEOUT_S + 5)
    assert sock.recv(1024) == b""
    return time.monotonic() - start


def test_a_silent_client_is_cut_off_after_the_read_timeout(endpoint):
    with socket.create_connection(("127.0.0.1", endpoint)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # and nothing more
        assert TIMEOUT_S * 0.8 <= _closed_after(sock)


def test_connections_past_the_cap_are_closed_and_health_comes_back(endpoint):
    held = [socket.create_connection(("127.0.0.1", endpoint)) for _ in range(2)]
    try:
        time.sleep(0.1)  # both accepted and waiting for their requests
        with socket.create_connection(("127.0.0.1", endpoint)) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _closed_after(extra) < TIMEOUT_S  # refused, not queued behind the held
        for sock in held:
            _closed_after(sock)
    finally:
        for sock in held:
            sock.close()
    status, body = http_get(f"http://127.0.0.1:{endpoint}/health")
    assert (status, body.strip()) == (200, "SERVING")
