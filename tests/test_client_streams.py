"""Leaving a stream early (break, or an exception in the loop body) cancels the call, for Client
and AsyncClient, whether or not the stream object is still referenced: the server ends the call
as CANCELLED and the engine frees the request."""
from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import ServerProcess, engine_is_idle, free_port, wait_until
from specserve.clients import AsyncClient, Client

# Far more tokens than the first chunk: a call that is not cancelled runs on and ends OK, which
# the server's per-code call counter tells apart from CANCELLED however fast the engine is.
LONG = dict(prompt="def add", max_new_tokens=400, ignore_eos=True)


class _LoopBodyError(Exception):
    pass


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def metrics_url(metrics_port) -> str:
    return f"http://127.0.0.1:{metrics_port}/metrics"


@pytest.fixture(scope="module")
def server(tiny_model, metrics_port):
    server = ServerProcess(tiny_model, "--metrics-port", str(metrics_port))
    yield server
    assert server.stop() == 0


def _ended_calls(metrics_url: str) -> dict[str, float]:
    """Generate calls the server has ended, by status code."""
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        body = reply.read().decode()
    return {sample.labels["code"]: sample.value
            for family in text_string_to_metric_families(body) for sample in family.samples
            if sample.name == "specserve_requests_total"}


def _assert_cancelled(metrics_url: str, client: Client, before: dict[str, float]) -> None:
    """The one call made since `before` ends (bounded wait), as CANCELLED, and the engine is
    idle again."""
    assert wait_until(lambda: sum(_ended_calls(metrics_url).values()) > sum(before.values()))
    after = _ended_calls(metrics_url)
    assert after.get("CANCELLED", 0) == before.get("CANCELLED", 0) + 1, (before, after)
    assert wait_until(lambda: engine_is_idle(client)), client.server_load()


# Each way of leaving early returns the stream (or None), which the test keeps referenced while
# it checks the server: a referenced stream must be cancelled too.
def _plain_loop_break(client: Client):
    for _ in client.generate_stream(**LONG):
        break


def _named_stream_break(client: Client):
    stream = client.generate_stream(**LONG)
    for _ in stream:
        break
    return stream


def _exception_in_loop_body(client: Client):
    stream = client.generate_stream(**LONG)
    with pytest.raises(_LoopBodyError):
        for _ in stream:
            raise _LoopBodyError
    return stream


@pytest.mark.parametrize("leave_early", [_plain_loop_break, _named_stream_break,
                                         _exception_in_loop_body])
def test_sync_stream_left_early_is_cancelled(server, metrics_url, leave_early):
    with server.client() as client:
        before = _ended_calls(metrics_url)
        kept = leave_early(client)  # noqa: F841 (referenced until the test ends)
        _assert_cancelled(metrics_url, client, before)


async def _async_plain_loop_break(client: AsyncClient):
    async for _ in client.generate_stream(**LONG):
        break


async def _async_named_stream_break(client: AsyncClient):
    stream = client.generate_stream(**LONG)
    async for _ in stream:
        break
    return stream


async def _async_exception_in_loop_body(client: AsyncClient):
    stream = client.generate_stream(**LONG)
    with pytest.raises(_LoopBodyError):
        async for _ in stream:
            raise _LoopBodyError
    return stream


@pytest.mark.asyncio
@pytest.mark.parametrize("leave_early", [_async_plain_loop_break, _async_named_stream_break,
                                         _async_exception_in_loop_body])
async def test_async_stream_left_early_is_cancelled(server, metrics_url, leave_early):
    with server.client() as sync_client:
        before = _ended_calls(metrics_url)
        async with AsyncClient(server.address) as client:
            kept = await leave_early(client)  # noqa: F841 (referenced until the test ends)
            # Checked from a thread, so that this event loop stays free to run the stream's
            # cleanup, as it would in an application that goes on awaiting.
            await asyncio.to_thread(_assert_cancelled, metrics_url, sync_client, before)
