"""The engine's outputs, from its socket to each request's stream, with the per-token work off
the event loop.

An `OutputReader` thread receives every EngineToServer message. For each scheduler step's
BatchOutput (one message per step, all its requests) it runs the per-token work of every
request in it (detokenising, stop strings, building the GenerateChunk: `OutputStream.on_output`)
and hands the results to the event loop, which takes everything handed over since it last
looked in one call. The loop then only merges the results into each request's
`RequestStream`: a consumer slower than the engine (a gRPC write waiting on flow control, a
busy loop) finds one chunk holding every step since its previous one. So a stream gets at most
one message per engine step, and fewer, each carrying more tokens, when the server falls
behind, instead of a backlog of one message per step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable, NamedTuple, Optional, Union

import zmq

from specserve.engine.wire import decode_batch
from specserve.proto import engine_ipc_pb2 as ipc
from specserve.proto import generate_pb2 as pb
from specserve.server.text.detokenizer import PendingTokens, decode_windows
from specserve.server.text.output_stream import EngineProgress, OutputStream, merge_chunks

logger = logging.getLogger("specserve.server.engine")

POLL_MS = 100  # how often an idle reader looks whether it should stop


class RequestStream:
    """One request's chunks as its consumer takes them; event-loop side, but for `outputs` (one
    OutputStream per sequence), which only the reader thread touches once the request is
    submitted."""

    def __init__(self, outputs: list[OutputStream]):
        self.outputs = outputs
        self.first_output: Optional[float] = None  # perf_counter() of the engine's first output
        self._progress = [EngineProgress()] * len(outputs)  # per sequence, latest delivered
        self._latest = 0  # the sequence delivered last
        self._pending: list[pb.GenerateChunk] = []  # not yet taken (merged when taken)
        self._error: Optional[Exception] = None
        self._waiter: Optional[asyncio.Future] = None

    @property
    def progress(self) -> EngineProgress:
        """The speculative counters summed over the sequences; the accept length is the latest
        delivered sequence's; the cached prompt tokens, those every sequence took from the
        prefix cache (what the request reused)."""
        return EngineProgress(sum(p.verify_steps for p in self._progress),
                              sum(p.accepted_drafts for p in self._progress),
                              self._progress[self._latest].accept_length,
                              min(p.cached_tokens for p in self._progress))

    async def next_chunks(self) -> list[pb.GenerateChunk]:
        """Everything delivered since the previous call: one chunk per sequence that has
        news, each holding all of that sequence's steps since. Raises the error that ended
        the stream (RequestRejected, EngineUnavailable, ...) once the chunks delivered before
        it are taken."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending, self._pending = self._pending, []
        by_sequence: dict[int, list[pb.GenerateChunk]] = {}
        for chunk in pending:
            by_sequence.setdefault(chunk.index, []).append(chunk)
        return [merge_chunks(chunks) for chunks in by_sequence.values()]

    def deliver(self, index: int, chunk: Optional[pb.GenerateChunk], progress: EngineProgress,
                now: float) -> None:
        if self.first_output is None:
            self.first_output = now
        self._progress[index], self._latest = progress, index
        if chunk is not None:
            self._pending.append(chunk)
            self._wake()

    def fail(self, error: Exception) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class StreamUpdate(NamedTuple):
    """What one engine output did to one request's stream (made by the reader thread)."""

    rid: str
    index: int                      # the sequence (0 .. n - 1)
    stream: RequestStream
    chunk: Optional[pb.GenerateChunk]
    progress: EngineProgress
    engine_finished: bool           # the engine's last output for this sequence
    stopped_by_stop_string: bool    # the chunk ends the sequence; the engine has not finished it
    error: Optional[Exception]      # the per-token work failed; the stream ends with it

    def apply(self, now: float) -> None:
        """Deliver it to its stream (on the loop); `now`: when the loop took it."""
        if self.error is not None:
            self.stream.fail(self.error)
        else:
            self.stream.deliver(self.index, self.chunk, self.progress, now)


# What the reader hands the loop, in the order it read them: stream updates, and the other
# messages (ready, rejected, load, failed) for the loop to handle.
Routed = Union[StreamUpdate, ipc.EngineToServer]


class OutputReader(threading.Thread):
    """Owns the socket the engine's outputs arrive on (ZeroMQ sockets stay in one thread)."""

    def __init__(self, socket: zmq.Socket, streams: dict[str, RequestStream],
                 loop: asyncio.AbstractEventLoop, on_routed: Callable[[list[Routed]], None]):
        super().__init__(name="specserve-outputs", daemon=True)
        self.socket = socket
        # Written by the loop only; read here (one dict lookup: atomic in CPython). A stream
        # removed meanwhile (aborted) may still get an update, which nobody then reads.
        self.streams = streams
        self.loop = loop
        self.on_routed = on_routed
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._routed: list[Routed] = []  # read, not yet handed to the loop
        self._handover_scheduled = False

    def stop(self) -> None:
        """Stop reading (within POLL_MS); join() to wait for the socket to be closed."""
        self._stopping.set()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.socket.poll(POLL_MS):
                    continue
                self._hand_over(self.route(ipc.EngineToServer.FromString(self.socket.recv())))
        except RuntimeError:  # the event loop was closed under us: the server is gone
            pass
        except Exception as e:  # a bug: no output would reach a stream again
            logger.exception("the engine-output reader failed")
            failed = ipc.EngineFailed(message=f"the server's engine-output reader failed: {e!r}")
            self._hand_over([ipc.EngineToServer(failed=failed)])
        finally:
            self.socket.close(linger=0)

    def route(self, message: ipc.EngineToServer) -> list[Routed]:
        """What one message from the engine does to the streams (the per-token work of a
        step's batch), for the loop to apply."""
        if message.WhichOneof("kind") != "batch":
            return [message]
        routed: list[Routed] = []
        live = []  # (engine output, its stream, its sequence's OutputStream)
        for out in decode_batch(message.batch):
            stream = self.streams.get(out.rid)
            if stream is None:  # aborted by the server meanwhile
                continue
            output = stream.outputs[out.index]
            if output.finished:  # ended by a stop string; its aborted outputs trail in
                continue
            live.append((out, stream, output))
        # The step's detokenisation, all streams in one call (see decode_windows).
        decoded = decode_windows([PendingTokens(output.detokenizer, out.new_token_ids)
                                  for out, _, output in live if output.detokenizer is not None])
        decoded.reverse()  # popped in the order of `live`
        for out, stream, output in live:
            chunk, error = None, None
            try:
                chunk = output.on_output(out, decoded.pop() if output.detokenizer else None)
            except Exception as e:  # noqa: BLE001 - a bad output ends its request, not the server
                logger.exception("request %s: processing the engine's output failed", out.rid)
                error = e
            if chunk is not None and out.index:  # (0 is the field's default)
                chunk.index = out.index
            routed.append(StreamUpdate(out.rid, out.index, stream, chunk, output.progress,
                                       out.finished, output.finished and not out.finished,
                                       error))
        return routed

    def _hand_over(self, routed: list[Routed]) -> None:
        """Queue for the loop; one wake-up of the loop for whatever it has not taken yet."""
        with self._lock:
            self._routed.extend(routed)
            if self._handover_scheduled:
                return  # the loop has not taken the previous ones yet: they go together
            self._handover_scheduled = True
        self.loop.call_soon_threadsafe(self._take)

    def _take(self) -> None:
        """On the loop: everything read so far, in order."""
        with self._lock:
            routed, self._routed = self._routed, []
            self._handover_scheduled = False
        self.on_routed(routed)

