"""The engine's outputs, from its socket to each request's stream, with the per-token work in
the detokenizer worker process (server/workers/detokenizer.py).

An `OutputReader` thread owns the sockets: it receives every EngineToServer message, forwards
each step's BatchOutput to the worker as raw bytes (no parsing: one recv and one send per
step), and receives the worker's answer, one message per step holding every sequence's chunk
already serialized (`TextUpdate`s with `ChunkPiece`s). It hands those, and the engine's other
messages (ready, rejected, load, failed), to the event loop, which takes everything handed over
since it last looked in one call. The loop then only routes bytes into each request's
`RequestStream`: a consumer slower than the engine (a gRPC write waiting on flow control, a busy
loop) finds one chunk holding every step since its previous one, joined as bytes
(`join_pieces`). So a stream gets at most one message per engine step, and fewer, each carrying
more tokens, when the server falls behind, instead of a backlog of one message per step.

Requests are opened and closed in the worker through the same thread, on the same socket as the
steps: the loop queues the command (`OutputReader.command`) before it sends the request to the
engine, and the reader sends the queued commands after receiving each engine message and before
forwarding it. So the worker always knows a request before its first output.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import pickle
import threading
from typing import Callable, Optional, Union

import zmq

from specserve.engine.outputs import FinishError
from specserve.proto import engine_ipc_pb2 as ipc
from specserve.server.text.output_stream import ChunkPiece, EngineProgress, ReadyChunk, join_pieces
from specserve.server.workers.detokenizer import COMMANDS, STEP, EngineSteps, TextUpdate

logger = logging.getLogger("specserve.server.engine")

POLL_MS = 100  # how often an idle reader looks whether it should stop (and sends commands)
# An EngineToServer message whose first byte is this holds a BatchOutput (field 2,
# length-delimited): forwarded to the worker without parsing it.
_BATCH_TAG = 0x12


class SequenceFailed(Exception):
    """A sequence of the request failed: the engine's "error" finish (e.g. its grammar did not
    compile, or the grammar service died under it), or the detokenizer worker could not process
    its output (INTERNAL). The request's stream ends with it."""

    def __init__(self, index: int, error: FinishError):
        super().__init__(error.message)
        self.index = index      # the sequence (0 .. n - 1)
        self.error = error


class RequestStream:
    """One request's chunks as its consumer takes them (event-loop side)."""

    def __init__(self, n: int = 1):
        self.n = n  # sequences
        self.first_output: Optional[float] = None  # perf_counter() of the engine's first output
        # The engine's TTFT stamps of the first sequence to get tokens (StepOutput.stamps).
        self.engine_stamps: Optional[tuple] = None
        self._progress = [EngineProgress()] * n  # per sequence, latest delivered
        self._latest = 0  # the sequence delivered last
        self._pending: list[tuple[int, ChunkPiece]] = []  # not yet taken (joined when taken)
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

    async def next_chunks(self) -> list[ReadyChunk]:
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
        if len(pending) == 1:
            index, piece = pending[0]
            return [join_pieces(index, [piece])]
        by_sequence: dict[int, list[ChunkPiece]] = {}
        for index, piece in pending:
            by_sequence.setdefault(index, []).append(piece)
        return [join_pieces(index, pieces) for index, pieces in by_sequence.items()]

    def deliver(self, index: int, piece: Optional[ChunkPiece], progress: EngineProgress,
                now: float, stamps: Optional[tuple] = None) -> None:
        if self.first_output is None:
            self.first_output = now
        if stamps is not None and self.engine_stamps is None:
            self.engine_stamps = stamps
        self._progress[index], self._latest = progress, index
        if piece is not None:
            self._pending.append((index, piece))
            self._wake()

    def fail(self, error: Exception) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


# What the reader hands the loop, in the order it read them: the worker's updates (and the
# engine steps a batch reported), and the engine's other messages (ready, rejected, load,
# failed) for the loop to handle.
Routed = Union[TextUpdate, EngineSteps, ipc.EngineToServer]


class OutputReader(threading.Thread):
    """Owns the socket the engine's outputs arrive on and both sockets to the detokenizer
    worker (ZeroMQ sockets stay in one thread)."""

    def __init__(self, socket: zmq.Socket, to_worker: zmq.Socket, from_worker: zmq.Socket,
                 loop: asyncio.AbstractEventLoop, on_routed: Callable[[list[Routed]], None]):
        super().__init__(name="specserve-outputs", daemon=True)
        self.socket = socket
        self.to_worker = to_worker
        self.from_worker = from_worker
        self.loop = loop
        self.on_routed = on_routed
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._routed: list[Routed] = []  # read, not yet handed to the loop
        self._handover_scheduled = False
        # Commands for the worker, queued by the loop (deque appends and pops are atomic).
        self._commands: collections.deque = collections.deque()

    def command(self, command: tuple) -> None:
        """Queue a command for the worker (from the loop): sent before the next engine message
        is forwarded, or within POLL_MS."""
        self._commands.append(command)

    def stop(self) -> None:
        """Stop reading (within POLL_MS); join() to wait for the sockets to be closed."""
        self._stopping.set()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.from_worker, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(POLL_MS))
                if self.socket in events:
                    data = self.socket.recv()
                    # Every command queued before this message was made (a request's open
                    # before its first output) is queued now: send them first.
                    self._send_commands()
                    if data[:1] and data[0] == _BATCH_TAG:
                        self.to_worker.send_multipart([STEP, data], copy=False)
                    else:
                        self._hand_over([ipc.EngineToServer.FromString(data)])
                if self.from_worker in events:
                    self._hand_over(pickle.loads(self.from_worker.recv()))
                if not events:
                    self._send_commands()
            self._send_commands()  # a last "stop" for the worker
        except RuntimeError:  # the event loop was closed under us: the server is gone
            pass
        except Exception as e:  # a bug: no output would reach a stream again
            logger.exception("the engine-output reader failed")
            failed = ipc.EngineFailed(message=f"the server's engine-output reader failed: {e!r}")
            self._hand_over([ipc.EngineToServer(failed=failed)])
        finally:
            for sock in (self.socket, self.to_worker, self.from_worker):
                sock.close(linger=0)

    def _send_commands(self) -> None:
        commands = []
        while self._commands:
            commands.append(self._commands.popleft())
        if commands:
            self.to_worker.send_multipart(
                [COMMANDS, pickle.dumps(commands, protocol=pickle.HIGHEST_PROTOCOL)])

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
