"""Client: the blocking Python SDK.

    with Client("127.0.0.1:50051") as client:
        result = client.generate("def add(a, b):", max_new_tokens=32, temperature=0)
        with client.generate_stream(prompt="hello", stop=["\\n"]) as stream:
            for chunk in stream:
                print(chunk.text, end="")
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

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


class Stream:
    """The chunks of one Generate call, to be iterated once. The call is cancelled (the server
    then stops the request and frees its KV) when iteration ends before the last chunk (break,
    or an exception in the loop body), on `cancel()`, and on leaving the `with` block."""

    def __init__(self, call):
        self._call = call

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for msg in self._call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        finally:
            # A loop left early closes this generator (at once: nothing else references it),
            # which lands here; without the cancel a still-referenced stream would keep the
            # server generating to max_new_tokens. A no-op once the call has ended.
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()

    close = cancel

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()  # a no-op once the call has ended


class Client:
    """Blocking client. `target` is "host:port". Pass `tls=True` (system roots) or
    `tls_root_cert` (PEM bytes or path) for a TLS server."""

    def __init__(self, target: str, *, tls: bool = False,
                 tls_root_cert: Union[str, Path, bytes, None] = None):
        credentials = channel_credentials(tls, tls_root_cert)
        self._channel = (grpc.insecure_channel(target, options=channel_options())
                         if credentials is None else
                         grpc.secure_channel(target, credentials, options=channel_options()))
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate_stream(self, prompt: Optional[str] = None, *,
                        prompt_token_ids: Optional[Sequence[int]] = None,
                        messages: Optional[ChatMessages] = None,
                        add_special_tokens: Optional[bool] = None,
                        timeout: Optional[float] = None, **sampling) -> Stream:
        """Start a generation and return its Stream. The prompt is one of `prompt` (text),
        `prompt_token_ids`, or `messages` (a conversation, [{"role": ..., "content": ...}, ...],
        rendered by the server with the model's chat template). `add_special_tokens` (unset:
        True for text, False for messages) says whether a BOS is added to the prompt text.
        Sampling options (all optional):
        max_new_tokens, min_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
        seed, stop, stop_token_ids, ignore_eos, logprobs, top_logprobs, prompt_logprobs,
        presence_penalty, frequency_penalty, logit_bias ({token id: bias}), n (sequences; the
        chunks name theirs in Chunk.index), structured_output (one of {"json_object": True},
        {"json_schema": schema dict or JSON text}, {"regex": ...}, {"ebnf": ...}); see
        docs/grpc-api.md for their meaning. `timeout` (seconds) is the deadline.
        A value of the wrong type or out of its field's range raises InvalidArgument here."""
        request = build_request(prompt, prompt_token_ids, sampling, messages,
                                add_special_tokens)
        return Stream(self._stub.Generate(request, timeout=timeout))

    def generate(self, prompt: Optional[str] = None, *,
                 prompt_token_ids: Optional[Sequence[int]] = None,
                 messages: Optional[ChatMessages] = None,
                 add_special_tokens: Optional[bool] = None,
                 timeout: Optional[float] = None, **sampling
                 ) -> Union[GenerateResult, list[GenerateResult]]:
        """Generate to the end; same arguments as generate_stream. A GenerateResult, or with
        n > 1 one per sequence (in index order)."""
        with self.generate_stream(prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                                  add_special_tokens=add_special_tokens, timeout=timeout,
                                  **sampling) as stream:
            return one_or_all(results_from_chunks(stream), sampling)

    def tokenize(self, prompt: Optional[str] = None, *,
                 messages: Optional[ChatMessages] = None,
                 add_special_tokens: Optional[bool] = None,
                 add_generation_prompt: Optional[bool] = None,
                 timeout: Optional[float] = 10.0) -> list[int]:
        """The token ids the server gives a text or a conversation (`messages`, rendered with
        the model's chat template) in a generate call with the same arguments."""
        request = build_tokenize_request(prompt, messages, add_special_tokens,
                                         add_generation_prompt)
        reply = self._unary(self._stub.Tokenize, request, timeout)
        return list(reply.token_ids)

    def detokenize(self, token_ids: Sequence[int], timeout: Optional[float] = 10.0) -> str:
        """The text of token ids, decoded with the model's tokenizer."""
        request = build_detokenize_request(token_ids)
        return (self._unary(self._stub.Detokenize, request, timeout)).text

    def model_info(self, timeout: Optional[float] = 10.0) -> pb.ModelInfo:
        return self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def server_load(self, timeout: Optional[float] = 10.0) -> pb.ServerLoad:
        return self._unary(self._stub.GetServerLoad, pb.GetServerLoadRequest(), timeout)

    def flush_cache(self, timeout: Optional[float] = 10.0) -> int:
        """Free the server's cached prefixes that no running request uses; returns the KV
        slots that stay cached (those running requests use)."""
        return self._unary(self._stub.FlushCache, pb.FlushCacheRequest(), timeout).kv_cached_tokens

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """The grpc.health.v1 status name, e.g. "SERVING" or "NOT_SERVING"."""
        reply = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service),
                            timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_until_serving(self, timeout: float = 600.0, poll_interval: float = 0.2) -> None:
        """Block until health reports SERVING; Unavailable if it does not within `timeout`."""
        deadline = time.monotonic() + timeout
        status = "no answer"
        while time.monotonic() < deadline:
            try:
                status = self.health(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                if status == "SERVING":
                    return
            except Unavailable as e:
                status = e.details
            time.sleep(poll_interval)
        raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                          f"not SERVING after {timeout:.0f} s (last: {status})")

    def _unary(self, method, request, timeout):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
