"""GenerationService: the gRPC front of the generation core (server/generation.py)."""
from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from typing import AsyncIterator, Callable, TypeVar

import grpc

from specserve.engine.wire import info_to_proto, load_to_proto
from specserve.proto import generate_pb2 as pb
from specserve.server.cluster.replica_set import ReplicaSet
from specserve.server.engine_client import EngineUnavailable
from specserve.server.errors import InvalidRequest
from specserve.server.generation import GenerationCore, RefusalKind, Refused, Served
from specserve.server.ops.health import GENERATION_SERVICE
from specserve.server.text.output_stream import ReadyChunk
from specserve.server.text.validation import ValidatedRequest, parse_request

logger = logging.getLogger("specserve.server")

T = TypeVar("T")

# The calls' preparation: module-level functions of the request bytes, so that a tokenizer worker
# process can run them (functools.partial pickles); they return plain values (protobuf messages
# do not pickle).
def _tokenize(served: Served, request: bytes) -> list[int]:
    return served.validator.tokenize(parse_request(pb.TokenizeRequest, request))


def _detokenize(served: Served, request: bytes) -> str:
    ids = parse_request(pb.DetokenizeRequest, request).token_ids
    return served.validator.detokenize(list(ids))


def _chunk_bytes(chunk: ReadyChunk) -> bytes:
    """A Generate response: the chunk the detokenizer worker serialized, written as it is."""
    return chunk.data


_STATUS_CODES = {RefusalKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
                 RefusalKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 RefusalKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
                 RefusalKind.INTERNAL: grpc.StatusCode.INTERNAL}


class GenerationServicer:
    def __init__(self, core: GenerationCore):
        self.core = core

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the service with requests as raw bytes, which the servicer parses itself:
        a malformed message is then refused as INVALID_ARGUMENT, logged and counted like any
        other refusal (gRPC's own deserializer answers UNKNOWN and logs a traceback)."""
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, response_serializer=_chunk_bytes),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.GetModelInfo, response_serializer=pb.ModelInfo.SerializeToString),
            "GetServerLoad": grpc.unary_unary_rpc_method_handler(
                self.GetServerLoad, response_serializer=pb.ServerLoad.SerializeToString),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                self.Tokenize, response_serializer=pb.TokenizeResponse.SerializeToString),
            "Detokenize": grpc.unary_unary_rpc_method_handler(
                self.Detokenize, response_serializer=pb.DetokenizeResponse.SerializeToString),
            "FlushCache": grpc.unary_unary_rpc_method_handler(
                self.FlushCache, response_serializer=pb.FlushCacheResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers),))

    # --- Generate --------------------------------------------------------------------------
    async def Generate(self, request: bytes,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[ReadyChunk]:
        rid = uuid.uuid4().hex
        # The id in the log lines about this call, for the client to quote.
        await context.send_initial_metadata((("x-request-id", rid),))

        def cancel_code() -> str:
            # gRPC ends the handler both when the client cancels and when the deadline passes.
            remaining = context.time_remaining()
            return ("DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0
                    else "CANCELLED")

        try:
            # aclosing: if gRPC closes this generator (client gone), the core's cleanup (the
            # engine abort) runs now rather than whenever it is garbage collected.
            async with contextlib.aclosing(self.core.generate(
                    rid, functools.partial(_validate, request=request), cancel_code)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Refused as refusal:
            await context.abort(_STATUS_CODES[refusal.kind], refusal.message)

    # --- Tokenize, Detokenize: the validator's code, as for Generate and the HTTP front -----
    async def Tokenize(self, request: bytes,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        ids = await self._tokenizer_call(context, "Tokenize",
                                         functools.partial(_tokenize, request=request))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: bytes,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        text = await self._tokenizer_call(context, "Detokenize",
                                          functools.partial(_detokenize, request=request))
        return pb.DetokenizeResponse(text=text)

    async def _tokenizer_call(self, context: grpc.aio.ServicerContext, what: str,
                              fn: Callable[[Served], T]) -> T:
        try:
            return await self.core.tokenizer_call(what, fn)
        except Refused as refusal:
            await context.abort(_STATUS_CODES[refusal.kind], refusal.message)

    # --- info and load ---------------------------------------------------------------------
    async def GetModelInfo(self, request: bytes,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._parse_unary(pb.GetModelInfoRequest, request, context)
        served = self.core.served
        if served is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still starting")
        reply = info_to_proto(served.info)
        reply.max_prompt_tokens = served.limits.max_prompt_tokens
        reply.max_new_tokens_cap = served.limits.max_new_tokens_cap
        return reply

    async def GetServerLoad(self, request: bytes,
                            context: grpc.aio.ServicerContext) -> pb.ServerLoad:
        await self._parse_unary(pb.GetServerLoadRequest, request, context)
        load = await self._engine_load(context)
        reply = load_to_proto(load)
        if isinstance(self.core.engine, ReplicaSet):
            reply.replicas.extend(row.to_proto() for row in self.core.engine.last_rows)
        reply.num_active_streams = self.core.num_active_streams
        reply.max_active_streams = self.core.max_active_streams
        return reply

    async def FlushCache(self, request: bytes,
                         context: grpc.aio.ServicerContext) -> pb.FlushCacheResponse:
        await self._parse_unary(pb.FlushCacheRequest, request, context)
        load = await self._engine_load(context, flush_prefix_cache=True)
        logger.info("prefix cache flushed by %s; %d slots stay pinned by running requests",
                    context.peer(), load.kv_cached_tokens)
        return pb.FlushCacheResponse(kv_cached_tokens=load.kv_cached_tokens)

    async def _engine_load(self, context: grpc.aio.ServicerContext, flush_prefix_cache: bool = False):
        """The engine's load report (UNAVAILABLE while it cannot answer), also into the gauges."""
        try:
            load = await self.core.engine.load(flush_prefix_cache=flush_prefix_cache)
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.core.metrics.observe_load(load)
        return load

    @staticmethod
    async def _parse_unary(message_class: type, request: bytes,
                           context: grpc.aio.ServicerContext) -> None:
        """Refuse a malformed info or load request (their messages have no fields to read)."""
        try:
            parse_request(message_class, request)
        except InvalidRequest as e:
            logger.info("%s from %s refused with INVALID_ARGUMENT: %s",
                        message_class.DESCRIPTOR.name, context.peer(), e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def _validate(served: Served, request: bytes) -> ValidatedRequest:
    return served.validator.validate(parse_request(pb.GenerateRequest, request))
