"""The HTTP side port (--metrics-port): Prometheus `/metrics` and a plain `/health`; 404 elsewhere.

`/health` answers 200 "SERVING" or 503 "NOT_SERVING", the same status as the gRPC health service,
for probes that speak only HTTP. It serves from its own threads, so it answers even while the
event loop is busy. A thread a connection, so both are bounded: at most `max_connections` at a
time (the next is closed at once: scrapers and probes retry), each cut off when the client is
silent for `read_timeout_s`. Idle or slow clients then hold a few dozen descriptors at most,
never the ones gRPC and the workers need.
"""
from __future__ import annotations

import socket
import threading
from typing import Callable, Iterable, Optional
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


MAX_CONNECTIONS = 64
READ_TIMEOUT_S = 10.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:
        """No access log: scrapes and probes come every few seconds."""


class _BoundedServer(ThreadingWSGIServer):
    """ThreadingWSGIServer with at most `max_connections` connections (threads) at a time."""

    max_connections = MAX_CONNECTIONS

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it will not release the slot
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        """ThreadingMixIn's body with the slot released before the socket is closed: a client
        that reconnects the moment it sees the close finds the slot free (released after the
        close, a prompt retry was refused now and then)."""
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._slots.release()
            self.shutdown_request(request)


class HttpEndpoint:
    def __init__(self, registry: CollectorRegistry, is_serving: Callable[[], bool],
                 max_connections: int = MAX_CONNECTIONS, read_timeout_s: float = READ_TIMEOUT_S):
        self._metrics_app = make_wsgi_app(registry)
        self._is_serving = is_serving
        self._max_connections, self._read_timeout_s = max_connections, read_timeout_s
        self._server: Optional[ThreadingWSGIServer] = None

    def start(self, host: str, port: int) -> int:
        """Listen (OSError if the port cannot be bound) and serve in a daemon thread; returns
        the bound port."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("_Server", (_BoundedServer,), {
            "address_family": family, "max_connections": self._max_connections})
        handler = type("_Handler", (_QuietHandler,), {"timeout": self._read_timeout_s})
        self._server = make_server(host, port, self._app, server_class, handler)
        threading.Thread(target=self._server.serve_forever, name="specserve-http",
                         daemon=True).start()
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/health":
            serving = self._is_serving()
            status = "200 OK" if serving else "503 Service Unavailable"
            return self._plain(start_response, status, "SERVING" if serving else "NOT_SERVING")
        return self._plain(start_response, "404 Not Found", "not found: try /metrics or /health")

    @staticmethod
    def _plain(start_response: Callable, status: str, body: str) -> list[bytes]:
        data = (body + "\n").encode()
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                                ("Content-Length", str(len(data)))])
        return [data]
