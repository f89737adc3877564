"""Typed SDK exceptions, mapped from gRPC status codes."""
from __future__ import annotations

import grpc


class SpecserveError(Exception):
    """Base of every error the SDK raises for a failed call; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(SpecserveError):
    """A request field is invalid or over a server limit; `details` starts with the field's
    name. The SDK raises it too, before sending, for a value the request cannot carry."""


class ResourceExhausted(SpecserveError):
    """The server is full (retry later) or the request message is over its size limit."""


class Unavailable(SpecserveError):
    """The server is starting, draining or its engine died; retrying with backoff may help."""


class DeadlineExceeded(SpecserveError):
    """The call's timeout passed; the server stopped the request."""


class Cancelled(SpecserveError):
    """The call was cancelled (e.g. the stream was closed before it ended)."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def error_from_rpc(error: grpc.RpcError) -> SpecserveError:
    """The typed exception for a failed sync or asyncio gRPC call."""
    code = error.code()
    return _BY_CODE.get(code, SpecserveError)(code, error.details() or "")
