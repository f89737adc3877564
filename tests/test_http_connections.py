"""The HTTP front's connections (server/fronts/openai/connections.py), in process on a small app:
a client too slow sending its headers or its body is cut off after the timeout (not before), a
well-behaved one is served; over the connection cap a new connection is answered 503 at once
(and the cap logged once, not per refusal), and connections are taken again once others close; bytes that are not HTTP are a 400 in
OpenAI's error shape. The timeouts are behaviour: each is checked as "not before the timeout,
within the timeout plus a generous slack"."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from specserve.server.config import ServerConfig
from specserve.server.fronts.openai.connections import (CAP_WARNING_INTERVAL_S, ConnectionLimits,
                                                       GuardedH11Protocol,
                                                       default_max_connections)
from specserve.server.fronts.openai.server import HttpApiServer

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 1.5
SLACK_S = 15.0  # a loaded CI machine: the cut-off only has to come, not come fast
DRIP_INTERVAL_S = 0.1


def _app(body_reads: list[str]) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("SERVING")

    @app.post("/echo")
    async def echo(request: Request) -> PlainTextResponse:
        try:
            body = await request.body()
        except Exception as e:  # the client cut off mid-body: the app sees it gone
            body_reads.append(type(e).__name__)
            raise
        body_reads.append("read")
        return PlainTextResponse(body)

    return app


@contextlib.asynccontextmanager
async def _serving(limits: ConnectionLimits, body_reads: list[str]) -> AsyncIterator[int]:
    server = HttpApiServer(_app(body_reads), "127.0.0.1", 0, limits)
    port = server.bind()
    await server.start()
    try:
        yield port
    finally:
        await server.stop()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _closed_by_server(reader: asyncio.StreamReader) -> None:
    """Until the server closes the connection (EOF or reset), discarding what it sent."""
    with contextlib.suppress(ConnectionResetError):
        while await reader.read(65536):
            pass


async def _drip_until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             byte: bytes, start: float) -> float:
    """Send `byte` every DRIP_INTERVAL_S until the server closes the connection; the seconds
    from `start` (taken before the server could arm its deadline) until then."""
    closed = asyncio.ensure_future(_closed_by_server(reader))
    try:
        while not closed.done():
            with contextlib.suppress(ConnectionError):
                writer.write(byte)
                await writer.drain()
            await asyncio.wait([closed], timeout=DRIP_INTERVAL_S)
            assert time.monotonic() - start < SLACK_S, "the slow client was never cut off"
    finally:
        writer.close()
    return time.monotonic() - start


async def _get_health(port: int, reader=None, writer=None) -> bytes:
    """GET /health on a new connection (or the one given, kept open); the response's head."""
    if reader is None:
        reader, writer = await _connect(port)
    writer.write(b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SLACK_S)
    await reader.readexactly(len(b"SERVING"))
    return head


LIMITS = ConnectionLimits(max_connections=64, header_timeout_s=HEADER_TIMEOUT_S,
                          body_timeout_s=BODY_TIMEOUT_S)


@pytest.mark.asyncio
@pytest.mark.parametrize("after_a_response", [False, True])
async def test_slow_headers_are_cut_off(after_a_response):
    """Headers sent a byte at a time: cut off once the header timeout has passed since the
    connection opened, or (keep-alive) since the previous response ended."""
    async with _serving(LIMITS, []) as port:
        start = time.monotonic()
        reader, writer = await _connect(port)
        if after_a_response:
            start = time.monotonic()
            assert (await _get_health(port, reader, writer)).startswith(b"HTTP/1.1 200")
        writer.write(b"GET /health HTTP/1.1\r\nhost: test\r\n")
        elapsed = await _drip_until_closed(reader, writer, b"x", start)
        assert elapsed >= HEADER_TIMEOUT_S - 0.01  # the deadline, not something sooner
        # Others are served meanwhile and after.
        assert (await _get_health(port)).startswith(b"HTTP/1.1 200")


@pytest.mark.asyncio
async def test_slow_body_is_cut_off_and_the_app_sees_the_client_gone():
    body_reads: list[str] = []
    async with _serving(LIMITS, body_reads) as port:
        reader, writer = await _connect(port)
        start = time.monotonic()
        writer.write(b"POST /echo HTTP/1.1\r\nhost: test\r\ncontent-length: 1000\r\n\r\n12345")
        # Past the header timeout without being cut off: the headers' deadline ended with them.
        elapsed = await _drip_until_closed(reader, writer, b"y", start)
        assert elapsed >= BODY_TIMEOUT_S - 0.01 > HEADER_TIMEOUT_S
        assert body_reads == ["ClientDisconnect"]
        # A body sent at once is read whole.
        reader, writer = await _connect(port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: test\r\ncontent-length: 5\r\n\r\nhello")
        await writer.drain()
        response = await asyncio.wait_for(reader.readuntil(b"hello"), SLACK_S)
        assert response.startswith(b"HTTP/1.1 200") and body_reads[-1] == "read"
        writer.close()


@pytest.mark.asyncio
async def test_a_client_within_the_timeouts_keeps_its_connection():
    """Headers and body in pieces, well within the timeouts: served, and the keep-alive
    connection serves a second request."""
    async with _serving(ConnectionLimits(64, header_timeout_s=10, body_timeout_s=10), []) as port:
        reader, writer = await _connect(port)
        for piece in (b"POST /echo HTTP/1.1\r\n", b"host: test\r\ncontent-length: 4\r\n\r\n",
                      b"ab", b"cd"):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(DRIP_INTERVAL_S)
        response = await asyncio.wait_for(reader.readuntil(b"abcd"), SLACK_S)
        assert response.startswith(b"HTTP/1.1 200")
        assert (await _get_health(port, reader, writer)).startswith(b"HTTP/1.1 200")
        writer.close()


@pytest.mark.asyncio
async def test_connections_over_the_cap_are_refused_at_once_and_taken_again_later(caplog,
                                                                                 monkeypatch):
    monkeypatch.setattr(GuardedH11Protocol, "_cap_warned_at", -CAP_WARNING_INTERVAL_S)
    cap = 3
    limits = ConnectionLimits(max_connections=cap, header_timeout_s=60, body_timeout_s=60)
    async with _serving(limits, []) as port:
        held = [await _connect(port) for _ in range(cap)]  # idle: they send nothing
        # The cap's connections are open: the next is answered 503 and closed, unread.
        for _ in range(2):
            reader, writer = await _connect(port)
            refusal = await asyncio.wait_for(reader.read(), SLACK_S)
            head, _, body = refusal.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head
            error = json.loads(body)["error"]
            assert error["type"] == "service_unavailable" and f"{cap} HTTP connections" in \
                error["message"], error
            writer.close()
        warnings = [r.getMessage() for r in caplog.records if "the cap" in r.getMessage()]
        assert warnings == [f"HTTP front: {cap} connections open, the cap "
                            "(--http-max-connections); refusing new ones with 503"]
        # The held ones are served...
        assert (await _get_health(port, *held[0])).startswith(b"HTTP/1.1 200")
        # ...and once one closes, a new connection is taken again.
        held[1][1].close()

        async def served() -> bool:
            reader, writer = await _connect(port)
            try:
                return (await _get_health(port, reader, writer)).startswith(b"HTTP/1.1 200")
            except (asyncio.IncompleteReadError, ConnectionError):
                return False
            finally:
                writer.close()

        deadline = time.monotonic() + SLACK_S
        while not await served():
            assert time.monotonic() < deadline, "no connection taken after one closed"
            await asyncio.sleep(0.05)
        for _, writer in held:
            writer.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("request_bytes", [
    b"\x16\x03\x01 not http\r\n\r\n",
    # Headers past h11's 16 KiB and not ended yet: refused without waiting for their end.
    b"GET /health HTTP/1.1\r\nhost: test\r\nx-big: " + b"a" * 20_000,
])
async def test_bytes_that_are_not_http_are_a_400_in_openai_shape(request_bytes):
    async with _serving(LIMITS, []) as port:
        reader, writer = await _connect(port)
        writer.write(request_bytes)
        response = await asyncio.wait_for(reader.read(), SLACK_S)
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400")
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith("request: not a valid HTTP/1.1 request"), error
        writer.close()


def test_the_cap_defaults_to_half_the_descriptor_limit():
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert default_max_connections() == soft // 2
    assert ConnectionLimits.of(ServerConfig()).max_connections == soft // 2
    assert ConnectionLimits.of(ServerConfig(http_max_connections=7)) == ConnectionLimits(
        7, ServerConfig.http_header_timeout_s, ServerConfig.http_body_timeout_s)
    for bad in ({"http_max_connections": 0}, {"http_header_timeout_s": 0},
                {"http_body_timeout_s": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig(**bad)
