"""AsyncClient: the asyncio Python SDK, with the same methods as Client.

    async with AsyncClient("127.0.0.1:50051") as client:
        result = await client.generate("def add(a, b):", max_new_tokens=32)
        async with client.generate_stream(prompt="hello") as stream:
            async for chunk in stream:
                print(chunk.text, end="")
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Sequence, Union

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.clients.errors import Unavailable, error_from_rpc
from specserve.clients.messages import (ChatMessages, build_detokenize_request, build_request,
                                        build_tokenize_request, channel_credentials,
                                        channel_options, chunk_from_proto, one_or_all,
                                        results_from_chunks)
from specserve.clients.types import Chunk, GenerateResult
from specserve.proto import generate_pb2 as pb
from specserve.proto import generate_pb2_grpc as pb_grpc


class AsyncStream:
    """The chunks of one Generate call, to be iterated once. The call is cancelled (the server
    then stops the request and frees its KV) when iteration ends before the last chunk (break,
    or an exception in the loop body), on `cancel()`/`aclose()`, and on leaving `async with`."""

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            async for msg in self._call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        finally:
            # A loop left early drops this generator; asyncio then schedules its aclose() at
            # once (the event loop's async-generator finaliser), which lands here. Without the
            # cancel a still-referenced stream would keep the server generating to
            # max_new_tokens. A no-op once the call has ended.
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()  # a no-op once the call has ended


class AsyncClient:
    """Asyncio client. `target` is "host:port"; TLS as for Client. Create it inside the event
    loop that will use it."""

    def __init__(self, target: str, *, tls: bool = False,
                 tls_root_cert: Union[str, Path, bytes, None] = None,
                 options: Sequence[tuple[str, Any]] = ()):
        """options: gRPC channel arguments added to the client's own, e.g.
        ("grpc.use_local_subchannel_pool", 1) for a TCP connection of its own (clients of one
        process otherwise share one per server)."""
        credentials = channel_credentials(tls, tls_root_cert)
        options = channel_options() + list(options)
        self._channel = (grpc.aio.insecure_channel(target, options=options)
                         if credentials is None else
                         grpc.aio.secure_channel(target, credentials, options=options))
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate_stream(self, prompt: Optional[str] = None, *,
                        prompt_token_ids: Optional[Sequence[int]] = None,
                        messages: Optional[ChatMessages] = None,
                        add_special_tokens: Optional[bool] = None,
                        timeout: Optional[float] = None, **sampling) -> AsyncStream:
        """Start a generation; see Client.generate_stream for the options."""
        request = build_request(prompt, prompt_token_ids, sampling, messages,
                                add_special_tokens)
        return AsyncStream(self._stub.Generate(request, timeout=timeout))

    async def generate(self, prompt: Optional[str] = None, *,
                       prompt_token_ids: Optional[Sequence[int]] = None,
                       messages: Optional[ChatMessages] = None,
                       add_special_tokens: Optional[bool] = None,
                       timeout: Optional[float] = None, **sampling
                       ) -> Union[GenerateResult, list[GenerateResult]]:
        """Generate to the end: a GenerateResult, or with n > 1 one per sequence (in index
        order)."""
        async with self.generate_stream(prompt, prompt_token_ids=prompt_token_ids,
                                        messages=messages, add_special_tokens=add_special_tokens,
                                        timeout=timeout, **sampling) as stream:
            return one_or_all(results_from_chunks([chunk async for chunk in stream]), sampling)

    async def tokenize(self, prompt: Optional[str] = None, *,
                       messages: Optional[ChatMessages] = None,
                       add_special_tokens: Optional[bool] = None,
                       add_generation_prompt: Optional[bool] = None,
                       timeout: Optional[float] = 10.0) -> list[int]:
        """The token ids the server gives a text or a conversation (`messages`, rendered with
        the model's chat template) in a generate call with the same arguments."""
        request = build_tokenize_request(prompt, messages, add_special_tokens,
                                         add_generation_prompt)
        reply = await self._unary(self._stub.Tokenize, request, timeout)
        return list(reply.token_ids)

    async def detokenize(self, token_ids: Sequence[int], timeout: Optional[float] = 10.0) -> str:
        """The text of token ids, decoded with the model's tokenizer."""
        request = build_detokenize_request(token_ids)
        return (await self._unary(self._stub.Detokenize, request, timeout)).text

    async def model_info(self, timeout: Optional[float] = 10.0) -> pb.ModelInfo:
        return await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def server_load(self, timeout: Optional[float] = 10.0) -> pb.ServerLoad:
        return await self._unary(self._stub.GetServerLoad, pb.GetServerLoadRequest(), timeout)

    async def flush_cache(self, timeout: Optional[float] = 10.0) -> int:
        """Free the server's cached prefixes that no running request uses; returns the KV
        slots that stay cached (those running requests use)."""
        return (await self._unary(self._stub.FlushCache, pb.FlushCacheRequest(), timeout)).kv_cached_tokens

    async def health(self, service: str = "", timeout: float = 5.0) -> str:
        reply = await self._unary(self._health.Check,
                                  health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def wait_until_serving(self, timeout: float = 600.0, poll_interval: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        status = "no answer"
        while time.monotonic() < deadline:
            try:
                status = await self.health(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                if status == "SERVING":
                    return
            except Unavailable as e:
                status = e.details
            await asyncio.sleep(poll_interval)
        raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                          f"not SERVING after {timeout:.0f} s (last: {status})")

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
