"""The request-handling core that the gRPC and the HTTP front share: admission, preparation off
the event loop, engine submission, streaming through an OutputStream, cleanup, metrics and the
access log; and the tokenizer-only calls (Tokenize, Detokenize), in the same prepare threads.

A front turns its request into a `prepare` function (run in a prepare thread, it returns a
ValidatedRequest) and its refusals from `Refused.kind` into its own status codes. Everything
else, and so every rule about what is admitted and when the engine's KV is freed, lives here.
"""
from __future__ import annotations

import asyncio
import enum
import functools
import logging
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

from specserve.engine.config import EngineConfig
from specserve.engine.outputs import EngineInfo, FinishError
from specserve.server.config import ServerConfig
from specserve.server.engine_client import EngineClient, EngineUnavailable, RequestRejected
from specserve.server.errors import InvalidRequest
from specserve.server.ops.metrics import ServerMetrics
from specserve.server.output_router import SequenceFailed
from specserve.server.request_record import RequestRecord, finish_reason_name
from specserve.server.text.chat_template import ChatTemplate
from specserve.server.text.logprobs import TokenTexts
from specserve.server.text.output_stream import ReadyChunk
from specserve.server.text.reasoning import THINK_END
from specserve.server.text.tool_calls import default_tool_call_parser
from specserve.server.text.validation import RequestLimits, RequestValidator, ValidatedRequest
from specserve.server.workers.tokenizer_pool import PoolBroken, TokenizerPool

logger = logging.getLogger("specserve.server")

# Threads that parse, check, template and tokenize requests, off the event loop. Tokenizing
# releases the GIL, so a few run in parallel; admission bounds the calls waiting for one.
PREPARE_THREADS = 4

T = TypeVar("T")


class RefusalKind(enum.Enum):
    """Why a request was refused or failed. The names are gRPC's status codes, which the
    metrics count for both fronts."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class Refused(Exception):
    """A request ends with a refusal, or fails mid-generation (a sequence's "error" finish);
    `field` names the request field at fault, if one is."""

    def __init__(self, kind: RefusalKind, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field

    @classmethod
    def invalid(cls, error: InvalidRequest) -> "Refused":
        return cls(RefusalKind.INVALID_ARGUMENT, str(error), error.field)

    @classmethod
    def failed(cls, error: FinishError) -> "Refused":
        """A sequence the engine (or the detokenizer worker) failed: its code, and for
        INVALID_ARGUMENT the field its message starts with."""
        kind = RefusalKind.__members__.get(error.code, RefusalKind.INTERNAL)
        field = error.message.partition(":")[0] if kind is RefusalKind.INVALID_ARGUMENT else None
        return cls(kind, error.message, field)


@dataclass(frozen=True)
class Served:
    """What the engine serves, as the request path needs it; set once the engine is ready."""

    info: EngineInfo
    tokenizer: Any            # encode/decode, or None for a model without one
    limits: RequestLimits
    validator: RequestValidator  # it holds the chat template
    token_texts: TokenTexts      # each token's own text, for top and prompt logprobs
    reasoning_parser: Optional[str] = None   # chat: where the thinking ends (server/text/reasoning.py)
    tool_call_parser: str = "hermes"         # chat: the model's tool-call format


Prepare = Callable[[Served], ValidatedRequest]


class GenerationCore:
    def __init__(self, engine: EngineClient, engine_config: EngineConfig,
                 server_config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.server_config = server_config
        self.metrics = metrics
        self.max_active_streams = engine_config.max_running_requests + server_config.max_queue
        self.num_active_streams = 0
        self.draining = False  # set on SIGTERM: new calls are refused, running ones finish
        self.served: Optional[Served] = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._prepare_threads = ThreadPoolExecutor(PREPARE_THREADS,
                                                   thread_name_prefix="specserve-prepare")
        self._pool: Optional[TokenizerPool] = None  # --tokenizer-workers > 0, once ready

    def on_engine_ready(self, info: EngineInfo, tokenizer: Any) -> None:
        self.served = build_served(info, tokenizer, self.server_config)
        if self.server_config.tokenizer_workers:
            # The workers build their own Served from the same inputs (the tokenizer pickled).
            self._pool = TokenizerPool(self.server_config.tokenizer_workers, functools.partial(
                build_served, info, pickle.dumps(tokenizer), self.server_config))

    async def warm_up(self) -> None:
        """Start every tokenizer worker (spawned, each building its Served) before the server
        says SERVING: the pool starts them lazily, and the first calls paid 0.3-0.5 s for it
        (the TTFT stage "prepare" of the first requests on the CPU)."""
        if self._pool is None:
            return
        started = time.perf_counter()
        try:
            pids = await self._pool.pids()
        except PoolBroken as e:  # the pool restarts at the next call
            logger.warning("tokenizer workers did not start: %s", e)
            return
        logger.info("%d tokenizer workers started in %.2f s", len(pids), time.perf_counter() - started)

    def close(self) -> None:
        self._prepare_threads.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.close()

    async def in_prepare_thread(self, fn: Callable[[Served], T], served: Served) -> T:
        """Run fn (tokenizing, templating: slow for long inputs) off the event loop: in a
        tokenizer worker process (--tokenizer-workers; fn and its result are pickled), else in
        a prepare thread; Refused(INVALID_ARGUMENT) for its InvalidRequest, UNAVAILABLE if a
        worker died meanwhile."""
        try:
            if self._pool is not None:
                return await self._pool.run(fn)
            return await asyncio.get_running_loop().run_in_executor(self._prepare_threads, fn,
                                                                    served)
        except InvalidRequest as e:
            raise Refused.invalid(e) from None
        except PoolBroken as e:
            raise Refused(RefusalKind.UNAVAILABLE, str(e)) from None

    async def tokenizer_call(self, what: str, fn: Callable[[Served], T]) -> T:
        """A call that needs the tokenizer but not the engine (Tokenize, Detokenize): fn runs in
        a prepare thread; raises Refused. `what` names the call in the refusal's log line."""
        try:
            return await self.in_prepare_thread(fn, self.check_available())
        except Refused as refusal:
            logger.info("%s refused with %s: %s", what, refusal.kind.value, refusal.message)
            raise

    def check_available(self) -> Served:
        """What the engine serves, or Refused(UNAVAILABLE) while it is starting, dead or the
        server drains."""
        if self.draining:
            raise Refused(RefusalKind.UNAVAILABLE, "the server is shutting down")
        try:
            self.engine.check_available()
        except EngineUnavailable as e:
            raise Refused(RefusalKind.UNAVAILABLE, str(e)) from None
        return self.served

    async def generate(self, rid: str, prepare: Prepare,
                       cancel_code: Callable[[], str] = lambda: "CANCELLED",
                       on_prepared: Optional[Callable[[ValidatedRequest], None]] = None,
                       ) -> AsyncIterator[ReadyChunk]:
        """Admit, prepare and run one request, streaming its chunks; raises Refused.

        The caller must close this generator when it stops early (contextlib.aclosing), so that
        the engine request is aborted at once. cancel_code() names how a closed stream ended
        (for the metrics): CANCELLED, or DEADLINE_EXCEEDED when the front knows it was that.
        on_prepared(validated) runs on the loop once prepare has (in a worker process, its
        side effects on the caller's objects are lost: it returns what it found instead).
        """
        record = RequestRecord(rid, arrived=time.perf_counter())
        try:
            async for chunk in self._generate(record, prepare, on_prepared):
                yield chunk
        except Refused as refusal:
            record.status = refusal.kind.value
            logger.info("request %s %s with %s: %s", rid,
                        "failed" if "error" in record.finish_reasons else "refused", record.status,
                        refusal.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # A front closes the stream once it has every choice's end (the SSE body): OK.
            if not record.complete:
                record.status = cancel_code()
            raise
        finally:
            record.ended = time.perf_counter()
            self.metrics.observe_finished(record)
            logger.info("%s", record.access_log_line())

    async def _generate(self, record: RequestRecord, prepare: Prepare,
                        on_prepared: Optional[Callable[[ValidatedRequest], None]] = None,
                        ) -> AsyncIterator[ReadyChunk]:
        served = self.check_available()
        # Admitted before it is read, so that the calls waiting for a prepare thread are bounded
        # too.
        if self.num_active_streams >= self.max_active_streams:
            raise Refused(RefusalKind.RESOURCE_EXHAUSTED,
                          f"the server is full: {self.num_active_streams} calls in flight, the "
                          f"limit is max_running_requests + max_queue = {self.max_active_streams}; "
                          f"retry later")
        self.num_active_streams += 1
        record.admitted = time.perf_counter()
        self._idle.clear()
        self.metrics.active_streams.inc()
        try:
            validated = await self.in_prepare_thread(prepare, served)
            record.prepared = time.perf_counter()
            if on_prepared is not None:
                on_prepared(validated)
            record.prompt_tokens = len(validated.prompt_token_ids)
            spec = served.info.spec is not None
            record.finish_reasons = [None] * validated.sampling.n
            try:
                # The per-token work (detokenising, stop strings: one OutputStream per sequence,
                # each with its own text and finish) runs in the detokenizer worker; chunks
                # arrive here serialized, coalesced when this call falls behind.
                record.submitted = time.perf_counter()  # before: the engine may take it at once
                stream = self.engine.submit(record.rid, validated, spec)
            except EngineUnavailable as e:
                raise Refused(RefusalKind.UNAVAILABLE, str(e)) from None
            self.metrics.prompt_tokens.inc(record.prompt_tokens)
            unfinished = validated.sampling.n
            while unfinished:
                try:
                    chunks = await stream.next_chunks()
                except RequestRejected as e:
                    raise Refused(RefusalKind.INVALID_ARGUMENT, str(e),
                                  str(e).partition(":")[0]) from None
                except EngineUnavailable as e:
                    raise Refused(RefusalKind.UNAVAILABLE, str(e)) from None
                except SequenceFailed as e:  # the whole request fails (its others are aborted)
                    record.finish_reasons[e.index] = "error"
                    raise Refused.failed(e.error) from None
                now = time.perf_counter()
                if record.first_output is None:
                    record.first_output = stream.first_output
                    self.metrics.queue_time.observe(record.first_output - record.admitted)
                progress = stream.progress
                record.verify_steps, record.accepted_drafts = (progress.verify_steps,
                                                               progress.accepted_drafts)
                record.accept_length = progress.accept_length if spec else None
                record.cached_tokens = progress.cached_tokens
                for chunk in chunks:
                    first = chunk.num_tokens and record.first_token is None
                    if chunk.num_tokens:
                        self._on_tokens(record, chunk.num_tokens, now)
                    if chunk.finished:
                        unfinished -= 1
                        reason = finish_reason_name(chunk.finish_reason)
                        if reason not in ("stop", "length"):  # the engine aborted it on its own
                            record.finish_reasons[chunk.index] = "error"
                            raise Refused(RefusalKind.INTERNAL,
                                          f"the engine ended the request without a result ({reason})")
                        record.finish_reasons[chunk.index] = reason
                    yield chunk
                    if first:  # the front has written it (it asks for the next one after)
                        record.first_written = time.perf_counter()
                        if stream.engine_stamps is not None:
                            (record.engine_received, record.engine_admitted,
                             record.engine_first_token) = stream.engine_stamps
                        self.metrics.observe_ttft_stages(record)
        finally:
            # Cancelled, past its deadline, stopped by a stop string or failed: the engine must
            # stop and free the KV. A no-op when the engine already finished the request.
            self.engine.abort(record.rid)
            self.num_active_streams -= 1
            if self.num_active_streams == 0:
                self._idle.set()
            self.metrics.active_streams.dec()

    def _on_tokens(self, record: RequestRecord, num_tokens: int, now: float) -> None:
        """Record and observe (live, not when the request ends) one chunk's tokens."""
        if record.first_token is None:
            record.first_token = now
            self.metrics.time_to_first_token.observe(now - record.arrived)
        else:
            self.metrics.inter_token_latency.observe(now - record.last_token)
        record.last_token = now
        record.completion_tokens += num_tokens
        self.metrics.generated_tokens.inc(num_tokens)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is running; False if some still are after timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def build_served(info: EngineInfo, tokenizer: Any, config: ServerConfig) -> Served:
    """What the request path needs of the engine's model; a tokenizer worker builds its own
    (`tokenizer` then pickled bytes)."""
    if isinstance(tokenizer, bytes):
        tokenizer = pickle.loads(tokenizer)
    room = info.max_context_len - 1  # the engine needs at least one free position
    limits = RequestLimits(
        vocab_size=info.vocab_size,
        max_prompt_tokens=min(config.max_prompt_tokens or room, room),
        max_new_tokens_cap=min(config.max_new_tokens_cap or room, room))
    template = ChatTemplate.of(tokenizer)
    return Served(
        info, tokenizer, limits,
        RequestValidator(tokenizer, limits, template,
                         reasoning_end_id=_reasoning_end_id(tokenizer, config.reasoning_parser),
                         reasoning=config.reasoning_parser is not None),
        TokenTexts(tokenizer), config.reasoning_parser,
        config.tool_call_parser or default_tool_call_parser(getattr(tokenizer, "chat_template", None)))


def _reasoning_end_id(tokenizer: Any, reasoning_parser: Optional[str]) -> Optional[int]:
    """The token a chat grammar starts after: </think>, when it is one token (reasoning models
    have it as one); None without a reasoning parser or such a token (the validator then refuses
    a grammar on a chat request, which could not wait for the thinking to end)."""
    if reasoning_parser is None or tokenizer is None:
        return None
    ids = tokenizer.encode(THINK_END, add_special_tokens=False)
    if len(ids) != 1:
        logger.warning("reasoning parser %s: %s is not one token of this tokenizer; structured "
                       "outputs on chat requests are refused", reasoning_parser, THINK_END)
        return None
    return ids[0]
