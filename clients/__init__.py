"""specserve Python SDK: Client (blocking) and AsyncClient (asyncio) for the gRPC API."""
from specserve.clients.async_client import AsyncClient, AsyncStream
from specserve.clients.client import Client, Stream
from specserve.clients.errors import (Cancelled, DeadlineExceeded, InvalidArgument,
                                      ResourceExhausted, SpecserveError, Unavailable)
from specserve.clients.types import (Chunk, GenerateResult, PromptTokenLogprob, SpecStats,
                                     TokenLogprob, Usage)

__all__ = ["Client", "AsyncClient", "Stream", "AsyncStream", "Chunk", "GenerateResult", "Usage",
           "SpecStats", "SpecserveError", "InvalidArgument", "ResourceExhausted", "Unavailable",
           "DeadlineExceeded", "Cancelled", "TokenLogprob", "PromptTokenLogprob"]
