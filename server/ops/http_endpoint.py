"""The HTTP side port (--metrics-port): Prometheus `/metrics` and a plain `/health`; 404 elsewhere.

`/health` answers 200 "SERVING" or 503 "NOT_SERVING", the same status as the gRPC health service,
for probes that speak only HTTP. It serves from its own threads, so it answers even while the
event loop is busy.
"""
from __future__ import annotations

import socket
import threading
from typing import Callable, Iterable, Optional
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:
        """No access log: scrapes and probes come every few seconds."""


class HttpEndpoint:
    def __init__(self, registry: CollectorRegistry, is_serving: Callable[[], bool]):
        self._metrics_app = make_wsgi_app(registry)
        self._is_serving = is_serving
        self._server: Optional[ThreadingWSGIServer] = None

    def start(self, host: str, port: int) -> int:
        """Listen (OSError if the port cannot be bound) and serve in a daemon thread; returns
        the bound port."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("_Server", (ThreadingWSGIServer,), {"address_family": family})
        self._server = make_server(host, port, self._app, server_class, _QuietHandler)
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
