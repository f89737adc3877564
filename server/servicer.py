"""GenerationService: admission, validation, streaming and cleanup of Generate calls."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Optional

import grpc

from specserve.engine.config import EngineConfig
from specserve.engine.outputs import EngineInfo
from specserve.engine.wire import info_to_proto, load_to_proto
from specserve.proto import generate_pb2 as pb
from specserve.server.config import ServerConfig
from specserve.server.engine_client import EngineClient, EngineUnavailable, RequestRejected
from specserve.server.health import GENERATION_SERVICE
from specserve.server.metrics import ServerMetrics
from specserve.server.output_stream import OutputStream
from specserve.server.validation import (InvalidRequest, RequestLimits, RequestValidator,
                                         ValidatedRequest, parse_request)

logger = logging.getLogger("specserve.server")

# Threads that parse, check and tokenize requests, off the event loop. Tokenizing releases the
# GIL, so a few run in parallel; admission bounds the calls waiting for one.
PREPARE_THREADS = 4


class _Refusal(Exception):
    """Ends a call with a status code; raised inside the servicer, turned into context.abort."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


class GenerationServicer:
    def __init__(self, engine: EngineClient, engine_config: EngineConfig,
                 server_config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.server_config = server_config
        self.metrics = metrics
        self.max_active_streams = engine_config.max_running_requests + server_config.max_queue
        self.num_active_streams = 0
        self.draining = False  # set on SIGTERM: new calls are refused, running ones finish
        self._idle = asyncio.Event()
        self._idle.set()
        self.info: Optional[EngineInfo] = None
        self.tokenizer: Any = None
        self.limits: Optional[RequestLimits] = None
        self.validator: Optional[RequestValidator] = None
        self._prepare_threads = ThreadPoolExecutor(PREPARE_THREADS,
                                                   thread_name_prefix="specserve-prepare")

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the service with requests as raw bytes, which the servicer parses itself:
        a malformed message is then refused as INVALID_ARGUMENT, logged and counted like any
        other refusal (gRPC's own deserializer answers UNKNOWN and logs a traceback)."""
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, response_serializer=pb.GenerateChunk.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.GetModelInfo, response_serializer=pb.ModelInfo.SerializeToString),
            "GetServerLoad": grpc.unary_unary_rpc_method_handler(
                self.GetServerLoad, response_serializer=pb.ServerLoad.SerializeToString),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers),))

    def close(self) -> None:
        self._prepare_threads.shutdown(wait=False, cancel_futures=True)

    def on_engine_ready(self, info: EngineInfo, tokenizer: Any) -> None:
        room = info.max_context_len - 1  # the engine needs at least one free position
        self.limits = RequestLimits(
            vocab_size=info.vocab_size,
            max_prompt_tokens=min(self.server_config.max_prompt_tokens or room, room),
            max_new_tokens_cap=min(self.server_config.max_new_tokens_cap or room, room))
        self.validator = RequestValidator(tokenizer, self.limits)
        self.tokenizer = tokenizer
        self.info = info

    # --- Generate --------------------------------------------------------------------------
    async def Generate(self, request: bytes,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        arrived = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            # aclosing: if gRPC closes this generator (client gone), the inner one's cleanup
            # (the engine abort) runs now rather than whenever it is garbage collected.
            async with contextlib.aclosing(self._generate(request, arrived)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except _Refusal as refusal:
            code = refusal.code
            logger.info("Generate from %s refused with %s: %s", context.peer(), code.name,
                        refusal.details)
            await context.abort(refusal.code, refusal.details)
        except (asyncio.CancelledError, GeneratorExit):
            # gRPC ends the handler both when the client cancels and when the deadline passes.
            remaining = context.time_remaining()
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0
                    else grpc.StatusCode.CANCELLED)
            raise
        finally:
            self.metrics.requests.labels(code.name).inc()
            self.metrics.request_duration.observe(time.perf_counter() - arrived)

    async def _generate(self, request: bytes,
                        arrived: float) -> AsyncIterator[pb.GenerateChunk]:
        if self.draining:
            raise _Refusal(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        try:
            self.engine.check_available()
        except EngineUnavailable as e:
            raise _Refusal(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        # Admitted before it is read, so that the calls waiting for a prepare thread are bounded
        # too.
        if self.num_active_streams >= self.max_active_streams:
            raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the server is full: {self.num_active_streams} calls in flight, the "
                           f"limit is max_running_requests + max_queue = {self.max_active_streams}; "
                           f"retry later")
        rid = uuid.uuid4().hex
        self.num_active_streams += 1
        self._idle.clear()
        self.metrics.active_streams.inc()
        try:
            try:
                validated = await self.prepare(request)
            except InvalidRequest as e:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            stream = OutputStream(self.tokenizer, validated,
                                  report_spec=self.info.spec is not None)
            try:
                events = self.engine.submit(rid, validated.prompt_token_ids, validated.sampling)
            except EngineUnavailable as e:
                raise _Refusal(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            first_token = True
            while not stream.finished:
                event = await events.get()
                if isinstance(event, RequestRejected):
                    raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(event))
                if isinstance(event, EngineUnavailable):
                    raise _Refusal(grpc.StatusCode.UNAVAILABLE, str(event))
                chunk = stream.on_output(event)
                if chunk is None:
                    continue
                if first_token and chunk.token_ids:
                    first_token = False
                    self.metrics.time_to_first_token.observe(time.perf_counter() - arrived)
                self.metrics.generated_tokens.inc(len(chunk.token_ids))
                yield chunk
        finally:
            # Cancelled, past its deadline, stopped by a stop string or failed: the engine must
            # stop and free the KV. A no-op when the engine already finished the request.
            self.engine.abort(rid)
            self.num_active_streams -= 1
            if self.num_active_streams == 0:
                self._idle.set()
            self.metrics.active_streams.dec()

    async def prepare(self, request: bytes) -> ValidatedRequest:
        """Parse, check and tokenize a Generate request in a prepare thread: a long prompt takes
        a while to tokenize, and the event loop must keep serving every other call meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(
            self._prepare_threads, self._parse_and_validate, request)

    def _parse_and_validate(self, request: bytes) -> ValidatedRequest:
        return self.validator.validate(parse_request(pb.GenerateRequest, request))

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no Generate call is running; False if some still are after timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # --- info and load ---------------------------------------------------------------------
    async def GetModelInfo(self, request: bytes,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._parse_unary(pb.GetModelInfoRequest, request, context)
        info = self.info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still starting")
        reply = info_to_proto(info)
        reply.max_prompt_tokens = self.limits.max_prompt_tokens
        reply.max_new_tokens_cap = self.limits.max_new_tokens_cap
        return reply

    async def GetServerLoad(self, request: bytes,
                            context: grpc.aio.ServicerContext) -> pb.ServerLoad:
        await self._parse_unary(pb.GetServerLoadRequest, request, context)
        try:
            load = await self.engine.load()
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.metrics.observe_load(load)
        reply = load_to_proto(load)
        reply.num_active_streams = self.num_active_streams
        reply.max_active_streams = self.max_active_streams
        return reply

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
