"""The detokenizer worker process: every stream's per-token work (detokenising, stop strings,
logprob texts, building the GenerateChunk) out of the server process.

The server's OutputReader thread forwards each engine message holding a step's BatchOutput here
as raw bytes, on the same socket (and so in the same order) as the requests it opens and
closes; the worker answers each step with one message: a list of `TextUpdate`s, each carrying a
sequence's chunk already serialized (`ChunkPiece`), which the event loop only routes.

With a stream interval above 1 (`--stream-interval N`), a sequence's pieces after its first are
held here until they carry N tokens (or the last one comes), then sent as one: fewer updates for
the loop to route and fewer messages for the front to write (each costs the event loop about as
much whatever it carries), at the price of a coarser stream. The first piece goes at once (the
time to first token is not paced), and so does a sequence's last.

Messages to the worker are multipart: [b"B", EngineToServer bytes] (a step) or [b"C", pickled
list of commands]: ("init", tokenizer pickle, stream interval), ("open", rid,
ValidatedRequest, report_spec), ("close", rid). Pickle is safe here: both ends are this server's
own processes, over ipc:// paths in its private directory (the engine already sends its
tokenizer pickled).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import zmq

from specserve.engine.outputs import EngineLoad, FinishError, StepOutput, StepStat
from specserve.engine.wire import decode_batch, decode_load, decode_step_stats
from specserve.proto import engine_ipc_pb2 as ipc
from specserve.server.text.detokenizer import PendingTokens, decode_windows
from specserve.server.text.logprobs import TokenTexts
from specserve.server.text.output_stream import ChunkPiece, OutputStream, chunk_piece, merge_pieces
from specserve.server.text.validation import ValidatedRequest

logger = logging.getLogger("specserve.server.detokenizer")

STEP = b"B"
COMMANDS = b"C"
IDLE_POLL_MS = 500  # how often an idle worker checks that the server is still there


class TextUpdate(NamedTuple):
    """What one engine output did to one sequence (made by the worker, routed by the loop)."""

    rid: str
    index: int                      # the sequence (0 .. n - 1)
    piece: Optional[ChunkPiece]     # None: nothing to stream
    progress: tuple                 # EngineProgress fields (the speculative counters)
    engine_finished: bool           # the engine's last output for this sequence
    stopped_by_stop_string: bool    # the chunk ends the sequence; the engine has not finished it
    # The sequence failed: the engine's "error" finish, or the per-token work here (INTERNAL);
    # the request's stream ends with it.
    error: Optional[FinishError]
    # The engine's TTFT stamps (StepOutput.stamps), on the sequence's first output with tokens.
    stamps: Optional[tuple] = None


class EngineSteps(NamedTuple):
    """The engine steps a BatchOutput reported (for the server's step-time metrics) and the
    engine's load after them (its load gauges)."""

    steps: list[StepStat]
    load: Optional[EngineLoad]


class _Paced:
    """One sequence's pieces held back by the stream interval."""

    __slots__ = ("started", "pieces", "tokens")

    def __init__(self):
        self.started = False  # its first piece has gone
        self.pieces: list[ChunkPiece] = []
        self.tokens = 0


class TextSteps:
    """Every open request's OutputStreams (one per sequence), fed one engine step at a time.
    Runs in the worker; tests drive it in-process. stream_interval: the tokens a sequence's
    pieces after its first are held for (1: none held)."""

    def __init__(self, tokenizer: Any, stream_interval: int = 1):
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.token_texts = TokenTexts(tokenizer)
        self.requests: dict[str, list[OutputStream]] = {}
        self.paced: dict[str, list[_Paced]] = {}  # with a stream interval: per sequence

    def open(self, rid: str, request: ValidatedRequest, report_spec: bool) -> None:
        self.requests[rid] = [OutputStream(self.tokenizer, request, report_spec, self.token_texts)
                              for _ in range(request.sampling.n)]
        if self.stream_interval > 1:
            self.paced[rid] = [_Paced() for _ in range(request.sampling.n)]

    def close(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.paced.pop(rid, None)

    def _pace(self, rid: str, index: int, piece: ChunkPiece) -> Optional[ChunkPiece]:
        """The piece to send now, with the held ones before it; None: held."""
        sequences = self.paced.get(rid)
        if sequences is None:  # closed in this step (another sequence failed): nothing held
            return piece
        paced = sequences[index]
        if not paced.started:  # the first piece: at once
            paced.started = True
            return piece
        paced.pieces.append(piece)
        paced.tokens += piece.num_tokens
        if paced.tokens < self.stream_interval and not piece.finished:
            return None
        return self._take_held(rid, index)

    def _take_held(self, rid: str, index: int) -> Optional[ChunkPiece]:
        """The sequence's held pieces as one (None: none), no longer held."""
        sequences = self.paced.get(rid)
        if sequences is None or not sequences[index].pieces:
            return None
        paced = sequences[index]
        pieces, paced.pieces, paced.tokens = paced.pieces, [], 0
        return pieces[0] if len(pieces) == 1 else merge_pieces(pieces)

    def step(self, outputs: list[StepOutput]) -> list[TextUpdate]:
        """The step's updates: the per-token work of every output of an open request, its
        detokenisation in one decode_batch call (decode_windows)."""
        live = []  # (engine output, its sequence's OutputStream)
        for out in outputs:
            streams = self.requests.get(out.rid)
            if streams is None:  # closed (aborted, or every sequence ended)
                continue
            output = streams[out.index]
            if output.finished:  # ended by a stop string; its aborted outputs trail in
                continue
            live.append((out, output))
        decoded = decode_windows([PendingTokens(output.detokenizer, out.new_token_ids)
                                  for out, output in live if output.detokenizer is not None])
        decoded.reverse()  # popped in the order of `live`
        updates = []
        for out, output in live:
            piece, error = None, out.error
            window = decoded.pop() if output.detokenizer else None
            try:
                chunk = None if error is not None else output.on_output(out, window)
                if chunk is not None:
                    if out.index:  # (0 is the field's default)
                        chunk.index = out.index
                    piece = chunk_piece(chunk)
                    if self.stream_interval > 1:
                        piece = self._pace(out.rid, out.index, piece)
                        if piece is None:  # held: nothing for the loop this step
                            continue
            except Exception as e:  # noqa: BLE001 - a bad output ends its request, not the worker
                logger.exception("request %s: processing the engine's output failed", out.rid)
                error = FinishError("INTERNAL", f"processing the engine's output failed: {e!r}")
            if error is not None:
                output.finished = True
                held = self._take_held(out.rid, out.index)
                if held is not None:  # what came before the error goes first, as unheld
                    updates.append(TextUpdate(out.rid, out.index, held, tuple(output.progress),
                                              False, False, None))
            updates.append(TextUpdate(out.rid, out.index, piece, tuple(output.progress),
                                      out.finished, output.finished and not out.finished
                                      and error is None, error, out.stamps))
            if error is not None or output.finished:
                streams = self.requests.get(out.rid)  # None: another sequence of it failed here
                if streams is not None and (error is not None or all(s.finished for s in streams)):
                    self.close(out.rid)
        return updates

    def command(self, command: tuple) -> None:
        kind = command[0]
        if kind == "open":
            self.open(*command[1:])
        elif kind == "close":
            self.close(command[1])


@dataclass(frozen=True)
class DetokenizerLink:
    """A detokenizer worker's addresses (ipc:// paths in the server's private directory)."""

    # server -> worker: steps and commands. The worker binds it and the server connects, so
    # that the server's messages queue (and its sends never block) whether or not the worker
    # is up yet, or still alive.
    inbox: str
    outbox: str   # worker -> server (bound by the server): a pickled list of TextUpdates a step


def run_detokenizer(link: DetokenizerLink) -> None:
    """Process entry: serve steps until the server says stop (or is gone)."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s detokenizer %(levelname)s %(message)s")
    for stop in (signal.SIGINT, signal.SIGTERM):  # sent to the whole process group (Ctrl-C,
        signal.signal(stop, signal.SIG_IGN)        # systemd): the server decides when it stops
    serve_detokenizer(link)


def serve_detokenizer(link: DetokenizerLink) -> None:
    """The worker's loop (tests run it in a thread): until a "stop" command or the server is
    gone."""
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(link.inbox)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.setsockopt(zmq.LINGER, 0)
    outbox.connect(link.outbox)
    server_pid = os.getppid()
    steps = TextSteps(None)
    try:
        while os.getppid() == server_pid:
            if not inbox.poll(IDLE_POLL_MS):
                continue
            kind, data = inbox.recv_multipart(copy=True)
            if kind == STEP:
                batch = ipc.EngineToServer.FromString(data).batch
                updates: list = steps.step(decode_batch(batch))
                if batch.step_extend or batch.HasField("load"):
                    updates.append(EngineSteps(decode_step_stats(batch), decode_load(batch)))
                if updates:
                    outbox.send(pickle.dumps(updates, protocol=pickle.HIGHEST_PROTOCOL))
                continue
            for command in pickle.loads(data):
                if command[0] == "init":
                    tokenizer = pickle.loads(command[1]) if command[1] else None
                    steps = TextSteps(tokenizer, command[2])
                elif command[0] == "stop":
                    return
                else:
                    steps.command(command)
    finally:
        inbox.close(linger=0)
        outbox.close()
        context.term()
