"""AsyncClient against a real server: concurrency, cancellation, typed errors."""
from __future__ import annotations

import asyncio

import pytest

from helpers import random_prompts
from server_harness import ServerProcess, engine_is_idle, wait_until
from specserve.clients import AsyncClient, DeadlineExceeded, InvalidArgument


@pytest.fixture(scope="module")
def server(tiny_model):
    server = ServerProcess(tiny_model, "--max-running-requests", "64")
    yield server
    assert server.stop() == 0


@pytest.mark.asyncio
async def test_64_concurrent_async_streams(server, tiny_model):
    from specserve.engine import Engine, EngineConfig, SamplingParams

    prompts = random_prompts(64, seed=5, min_len=2, max_len=20)
    with Engine(EngineConfig(model=tiny_model, device="cpu", dtype="float32", spec=None)) as engine:
        expected = engine.generate(prompt_token_ids=prompts,
                                   sampling=SamplingParams(max_new_tokens=10, temperature=0.0))

    async def stream_one(client: AsyncClient, prompt: list[int]) -> list[int]:
        ids = []
        async with client.generate_stream(prompt_token_ids=prompt, max_new_tokens=10,
                                          temperature=0) as stream:
            async for chunk in stream:
                ids += chunk.token_ids
        return ids

    async with AsyncClient(server.address) as client:
        got = await asyncio.gather(*(stream_one(client, p) for p in prompts))
        assert got == [e.token_ids for e in expected]
        load = await client.server_load()
        assert load.num_active_streams == 0


@pytest.mark.asyncio
async def test_async_cancel_and_errors(server):
    async with AsyncClient(server.address) as client:
        await client.wait_until_serving(60)
        stream = client.generate_stream("def add", max_new_tokens=500, ignore_eos=True)
        async for _ in stream:
            break
        stream.cancel()
        with pytest.raises(InvalidArgument, match="^INVALID_ARGUMENT: top_p:"):
            await client.generate("hi", top_p=0.0)
        with pytest.raises(DeadlineExceeded):
            await client.generate("hi", max_new_tokens=500, ignore_eos=True, timeout=0.2)
        result = await client.generate("hi", max_new_tokens=4, temperature=0, seed=7)
        assert result.finish_reason in ("stop", "length") and result.usage.prompt_tokens > 0
    with server.client() as sync_client:
        assert wait_until(lambda: engine_is_idle(sync_client)), sync_client.server_load()
