"""The FastAPI app of the OpenAI-compatible front: routes, error shapes and client disconnects.

Generation goes through the same GenerationCore as gRPC calls (admission, validation, streaming,
engine aborts), so this module only translates: requests in (bodies.py reads them, protocol.py
describes them), chunks out (responses.py), refusals into HTTP statuses. Every refusal, FastAPI's
and Starlette's own included (no such route, a wrong method), has OpenAI's error shape.
"""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import AsyncIterator, Awaitable, Callable, Optional, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specserve.engine.outputs import EngineInfo
from specserve.proto import generate_pb2 as pb
from specserve.server.fronts.openai.bodies import BodyTooLarge, read_body
from specserve.server.fronts.openai.chat_outputs import ChatOutputMode
from specserve.server.fronts.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest,
                                                  GenerationBody)
from specserve.server.fronts.openai.responses import (SSE_DONE, ResponseFormat, error_body, sse)
from specserve.server.generation import GenerationCore, RefusalKind, Refused, Served
from specserve.server.text.output_stream import ReadyChunk

T = TypeVar("T")

# HTTP status and OpenAI error type of each refusal.
_STATUSES = {RefusalKind.INVALID_ARGUMENT: (400, "invalid_request_error"),
             RefusalKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
             RefusalKind.UNAVAILABLE: (503, "service_unavailable"),
             RefusalKind.INTERNAL: (500, "server_error")}


class _ClientGone(Exception):
    """The client closed the connection before the response was ready."""


class _NotFound(Exception):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _in_api_terms(refusal: Refused, body: GenerationBody) -> Refused:
    """A refusal from the engine names the gRPC field (structured_output.json_schema, when its
    grammar did not compile): renamed to the body's own (response_format.json_schema.schema,
    tools[0].function.parameters, ...). Refusals of prepare are named so already."""
    field = refusal.field
    if field is None or field.split(".")[0] != "structured_output":  # not the API's own
        return refusal                                                  # structured_outputs
    body.grammar_field()  # sets the field the grammar came from (prepare's copy may be elsewhere)
    name = body.api_field(field)
    return Refused(refusal.kind, name + refusal.message[len(field):], name)


def _refusal_response(refusal: Refused, rid: Optional[str] = None) -> JSONResponse:
    status, type_ = _STATUSES[refusal.kind]
    return JSONResponse(error_body(refusal.message, type_, refusal.field), status_code=status,
                        headers={"x-request-id": rid} if rid else None)


async def _unless_client_leaves(request: Request, awaitable: Awaitable[T]) -> T:
    """Await while watching the connection: if the client leaves first, the work is cancelled
    (for generation: the engine request is aborted and its KV freed) and _ClientGone raised.
    Starlette does this itself for a streaming body, not for the wait before it starts."""
    work = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        # The body was read already: the next message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Refused):
            await work
        raise _ClientGone()
    return work.result()


def _model_card(info: EngineInfo) -> dict:
    return {"id": info.model, "object": "model", "created": 0, "owned_by": "specserve",
            "max_model_len": info.max_context_len, "weight_dtype": info.weight_dtype,
            "kv_cache_dtype": info.kv_cache_dtype}


def create_app(core: GenerationCore, registry: CollectorRegistry,
               is_serving: Callable[[], bool], max_body_bytes: int) -> FastAPI:
    """max_body_bytes: the largest request body read (a larger one is a 413)."""
    app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        # loc is ("body", field, ...): the field is the second element (a JSON error has none).
        loc = [str(part) for part in first.get("loc", ())[1:]]
        param = loc[0] if loc else "body"
        return JSONResponse(error_body(f"{'.'.join(loc) or 'body'}: {first.get('msg')}",
                                       "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's refusals: a path no route has (404), a method the route does not take
        (405, with its Allow header). OpenAI's own API words an unknown path this way."""
        what = {404: "Invalid URL", 405: "Method not allowed"}.get(error.status_code, error.detail)
        return JSONResponse(error_body(f"{what} ({request.method} {request.url.path})",
                                       "invalid_request_error"),
                            status_code=error.status_code, headers=error.headers)

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(request: Request, error: BodyTooLarge) -> JSONResponse:
        # The connection stays open: what the client still sends of the body is read and
        # dropped (bounded by the header timeout of the next request), so that it reads this
        # answer instead of a reset.
        return JSONResponse(error_body(str(error), "invalid_request_error", "body"),
                            status_code=413)

    @app.exception_handler(Refused)
    async def refused(request: Request, refusal: Refused) -> JSONResponse:
        return _refusal_response(refusal)

    @app.exception_handler(_NotFound)
    async def not_found(request: Request, error: _NotFound) -> JSONResponse:
        return JSONResponse(error_body(str(error), "invalid_request_error", error.param,
                                       "model_not_found"), status_code=404)

    @app.exception_handler(_ClientGone)
    @app.exception_handler(ClientDisconnect)  # gone while its body was read
    async def client_gone(request: Request, error: Exception) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    def served_model(model: Optional[str]) -> Served:
        served = core.check_available()
        if model is not None and model != served.info.model:
            raise _NotFound(f"model: this server serves {served.info.model!r}, not {model!r}",
                            "model")
        return served

    async def generate(body: GenerationBody, request: Request, chat: bool) -> Response:
        served = served_model(body.model)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        headers = {"x-request-id": rid}
        chunks = core.generate(rid, body.prepare,
                               on_prepared=getattr(body, "on_prepared", None))

        def shape() -> ResponseFormat:  # after the first chunk: prepare has run (echo text)
            return ResponseFormat(rid, served.info.model, chat, n=body.num_choices,
                                  token_texts=served.token_texts if body.wants_logprobs else None,
                                  echo_text=body.echo_text,
                                  chat_mode=body.chat_mode(served) if chat else ChatOutputMode())

        try:
            if not body.stream:
                collected = await _unless_client_leaves(request, _collect(chunks))
                return JSONResponse(shape().response(collected), headers=headers)
            # The first chunk is awaited before the response starts, so that a refusal still
            # gets its HTTP status rather than an error event in a 200 stream.
            first = await _unless_client_leaves(request, chunks.__anext__())
        except Refused as refusal:
            return _refusal_response(_in_api_terms(refusal, body), rid)
        return StreamingResponse(_events(shape(), first, chunks, body),
                                 media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, max_body_bytes)
        return await generate(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, max_body_bytes)
        return await generate(body, request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(core.check_available().info)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        return _model_card(served_model(model_id).info)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await read_body(request, TokenizeRequest, max_body_bytes)
        served = served_model(body.model)
        ids = await core.tokenizer_call("tokenize", body.token_ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": served.info.max_context_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await read_body(request, DetokenizeRequest, max_body_bytes)
        served_model(body.model)
        return {"prompt": await core.tokenizer_call("detokenize", body.text)}

    @app.get("/health")
    async def health() -> PlainTextResponse:
        serving = is_serving()
        return PlainTextResponse("SERVING" if serving else "NOT_SERVING",
                                 status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _collect(chunks: AsyncIterator[ReadyChunk]) -> list[pb.GenerateChunk]:
    """Every chunk of a stream (of every choice), parsed from the bytes the core routes (the
    gRPC front writes them as they are)."""
    async with contextlib.aclosing(chunks):
        return [chunk.message() async for chunk in chunks]


async def _events(shape: ResponseFormat, first: ReadyChunk,
                  chunks: AsyncIterator[ReadyChunk], body: GenerationBody,
                  ) -> AsyncIterator[bytes]:
    """The SSE body. Starlette cancels it when the client disconnects; aclosing then ends the
    core's generator at once, which aborts the engine request. A failure once the stream has
    started (a choice's "error" finish, the engine's death) is an `error` event, then [DONE]."""
    async with contextlib.aclosing(chunks):
        for opening in shape.first_chunks():
            yield sse(opening)
        chunk, unfinished = first, shape.n
        while True:
            for payload in shape.chunks(chunk.message()):
                yield sse(payload)
            unfinished -= chunk.finished
            if not unfinished:
                break
            try:
                chunk = await chunks.__anext__()
            except Refused as refusal:  # failed mid-stream: the 200 status is sent already
                refusal = _in_api_terms(refusal, body)
                status, type_ = _STATUSES[refusal.kind]
                yield sse(error_body(refusal.message, type_, refusal.field, str(status)))
                break
        if body.include_usage and not unfinished:
            yield sse(shape.usage_chunk())
        yield SSE_DONE
