"""The HTTP front's connections: how many may be open, and how long a client may take to send a
request, so that slow or idle clients cannot take the file descriptors that gRPC (in the same
process), the engine link and the workers need.

uvicorn's h11 protocol times out only a keep-alive connection that sends nothing after a
response: a client that sends its headers a byte at a time, or never finishes its body, is kept
for ever; and its `limit_concurrency` answers 503 only once a request's headers have arrived,
the descriptor held meanwhile. GuardedH11Protocol adds what is missing:
- above max_connections, a new connection is answered 503 and closed before anything is read;
- a request's headers must arrive within header_timeout_s of the connection opening or of the
  previous response ending (which also bounds the unread rest of a body answered early), and
  its body within body_timeout_s of its headers. Past its deadline a connection is cut off (the
  app, if it was reading the body, sees the client gone).
Headers larger than h11's limit (16 KiB) and bytes that are not HTTP are a 400, in OpenAI's
error shape like every other refusal of the front.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from specserve.server.config import ServerConfig
from specserve.server.fronts.openai.responses import error_body

logger = logging.getLogger("specserve.server")

CAP_WARNING_INTERVAL_S = 60.0  # refusals at the cap are logged once a minute, not each


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float

    @classmethod
    def of(cls, config: ServerConfig) -> ConnectionLimits:
        return cls(config.http_max_connections or default_max_connections(),
                   config.http_header_timeout_s, config.http_body_timeout_s)


def default_max_connections() -> int:
    """Half the process's file-descriptor limit: the other half stays for gRPC's connections,
    the engine's and workers' sockets and pipes, and the files the server opens."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:  # no limit to share: a cap as large as a big one
        soft = 1 << 20
    return max(1, soft // 2)


def _error_bytes(status: int, message: str, type_: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of an error response written by the protocol (no app involved)."""
    body = json.dumps(error_body(message, type_)).encode()
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")], body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and deadlines for reading a request (see
    the module's docstring). Give uvicorn.Config(http=...) a functools.partial binding limits."""

    _cap_warned_at = -CAP_WARNING_INTERVAL_S  # (monotonic) the front's last warning of the cap

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._refused = False
        self._deadline: Optional[asyncio.TimerHandle] = None
        # What the running deadline times: ("headers", the cycle answered last, None at first)
        # or ("body", the cycle reading it); None: nothing (a request is being answered).
        self._deadline_for: Optional[tuple[str, Optional[RequestResponseCycle]]] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._follow_request()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """503 and close, before reading anything: the descriptor is free again at once."""
        self._refused = True
        cap = self.limits.max_connections
        headers, body = _error_bytes(
            503, f"server: {cap} HTTP connections are open, the most this server takes "
                 "(--http-max-connections); retry later", "service_unavailable")
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\n"
                        + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n" + body)
        transport.close()
        now = time.monotonic()
        if now - GuardedH11Protocol._cap_warned_at >= CAP_WARNING_INTERVAL_S:
            GuardedH11Protocol._cap_warned_at = now
            logger.warning("HTTP front: %d connections open, the cap (--http-max-connections); "
                           "refusing new ones with 503", cap)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self._refused:  # never counted, nothing started
            return
        self._set_deadline(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse as a request, in OpenAI's error shape."""
        headers, body = _error_bytes(400, f"request: not a valid HTTP/1.1 request ({msg})",
                                     "invalid_request_error")
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    # --- deadlines ------------------------------------------------------------------------
    def _follow_request(self) -> None:
        """Time what the connection waits for: the next request's headers, the body of the
        one whose headers came, or nothing once a request is read (the app answers it)."""
        cycle = self.cycle
        if self.transport.is_closing():
            self._set_deadline(None)
        elif cycle is None or cycle.response_complete:
            self._set_deadline(("headers", cycle), self.limits.header_timeout_s)
        elif cycle.more_body:
            self._set_deadline(("body", cycle), self.limits.body_timeout_s)
        else:
            self._set_deadline(None)

    def _set_deadline(self, what: Optional[tuple[str, Optional[RequestResponseCycle]]],
                      timeout_s: float = 0.0) -> None:
        if what == self._deadline_for:  # already timed since it began
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._deadline_for = what
        if what is not None:
            self._deadline = self.loop.call_later(timeout_s, self._cut_off)

    def _cut_off(self) -> None:
        self._deadline = None
        what = self._deadline_for[0] if self._deadline_for else "request"
        logger.debug("HTTP client %s too slow sending a request's %s: connection closed",
                     self.client, what)
        self.transport.abort()
