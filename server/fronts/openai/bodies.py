"""The HTTP front's request bodies: read within the size limit, then decoded and validated, in a
thread when they are large.

FastAPI would read a body whole whatever its size and decode it on the event loop, so the
routes take their bodies from read_body instead. Its refusals: BodyTooLarge (413), and
RequestValidationError with the location ("body", field, ...) for a body that is not JSON,
nests deeper than MAX_NESTING, or does not fit the model (400, named by field).
"""
from __future__ import annotations

import asyncio
import json
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

# Larger bodies are decoded and validated in a thread: the event loop goes on between their
# steps (smaller ones take well under a millisecond). A thread holds the GIL while it decodes,
# so the size limit is what bounds one body's work.
OFF_LOOP_BYTES = 64 * 1024
# The deepest nesting of arrays and objects taken. The request goes on to be pickled for the
# tokenizer workers, where recursion stops at about 490 levels (Python's default limit; a
# deeper body was a 500), and json.loads at about 990; real bodies nest a few levels (OpenAI's
# strict schemas at most 10).
MAX_NESTING = 400


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"body: larger than the server limit of {limit} bytes "
                         f"(--max-message-bytes)")


async def read_body(request: Request, model: type[M], max_bytes: int) -> M:
    """The request's body as `model`. A Content-Length over max_bytes is refused before any
    of the body is read, and a body without one (chunked) as soon as it grows past max_bytes."""
    raw = await _read_bytes(request, max_bytes)
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_body, raw, model)
    return parse_body(raw, model)


async def _read_bytes(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > max_bytes:  # h11 refused a malformed one
        raise BodyTooLarge(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():  # starlette's ClientDisconnect if the client leaves
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes, model: type[M]) -> M:
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _invalid(f"arrays and objects nested deeper than {MAX_NESTING} levels") from None
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bytes not UTF-8
        raise _invalid(f"not valid JSON ({e})") from None
    # Cheap bound first: a body with fewer brackets than the limit cannot nest deeper.
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and _nesting(value) > MAX_NESTING:
        raise _invalid(f"arrays and objects nested deeper than {MAX_NESTING} levels")
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])}
                                      for error in e.errors()]) from None


def _nesting(value: object) -> int:
    """How deep arrays and objects nest in a decoded JSON value (level by level, no recursion)."""
    depth, level = 0, [value]
    while level:
        level = [v for v in level if isinstance(v, (dict, list))]
        depth += bool(level)
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def _invalid(message: str) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": message}])
