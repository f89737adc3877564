"""EngineClient: the server's handle on the engine process.

Starts `specserve.engine.process.run_engine_process` in a spawned child (or, through an
`EngineLauncher`, anywhere else: server/cluster runs it in a Ray replica actor), talks to it over
two ZeroMQ PUSH/PULL sockets on ipc:// paths (tcp:// ports for an engine on another host), and
routes the engine's per-step outputs to one RequestStream per request (through an OutputReader
thread and a detokenizer worker process that does the per-token work: server/output_router.py,
server/workers/detokenizer.py). If the child dies, every waiting caller gets EngineUnavailable
at once (the child's process sentinel is watched on the event loop, so nothing waits for a
timeout). A frozen or stuck child is found by the watchdog (server/ops/watchdog.py) from the
heartbeats on a third socket; it is then killed and handled as dead.
"""
from __future__ import annotations

import abc
import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from typing import Any, Callable, Optional

import zmq
import zmq.asyncio

from specserve.engine.config import EngineConfig, SamplingParams
from specserve.engine.outputs import EngineInfo, EngineLoad, GrammarHealth
from specserve.engine.process import ServerLink, ServerLinks, StartEngine, run_engine_process
from specserve.engine.wire import (add_request_to_proto, grammar_health_from_proto, info_from_proto,
                                   load_from_proto)
from specserve.proto import engine_ipc_pb2 as ipc
from specserve.server.ops.watchdog import EngineWatchdog
from specserve.server.output_router import OutputReader, RequestStream, Routed, SequenceFailed
from specserve.server.text.output_stream import EngineProgress
from specserve.server.text.validation import ValidatedRequest
from specserve.server.workers.detokenizer import (DetokenizerLink, EngineSteps, TextUpdate,
                                                   run_detokenizer)

logger = logging.getLogger("specserve.server.engine")

LOAD_QUERY_TIMEOUT_S = 10.0  # the engine answers between steps; a step is far shorter
SHUTDOWN_TIMEOUT_S = 10.0    # after that the child is terminated, then killed
EXIT_REPORT_GRACE_S = 1.0    # an engine that exited at start-up: time for its failure report


class EngineUnavailable(Exception):
    """The engine is not ready yet, has died, or is shutting down."""


class RequestRejected(Exception):
    """The engine refused a request; the message names the field (engine ValueError)."""


class EngineHandle(abc.ABC):
    """A started engine, wherever it runs: what the client needs to watch and stop it."""

    description: str  # for log lines, e.g. "pid 1234"

    @abc.abstractmethod
    def watch_exit(self, on_exit: Callable[[str], None]) -> None:
        """Call on_exit(reason) on the event loop once the engine has exited."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """The engine was asked to shut down: wait for it, and force it past a timeout."""

    @abc.abstractmethod
    async def kill(self) -> None:
        """Kill the engine now (it is frozen or stuck) and wait until it is gone."""


class EngineLauncher(abc.ABC):
    """Starts the engine process for a client, given the addresses the client bound."""

    # None: the engine runs on this host and the sockets are ipc:// paths; else the engine may
    # run on another host and the client binds tcp:// ports on this address.
    bind_host: Optional[str] = None

    @abc.abstractmethod
    def launch(self, config: EngineConfig, link: ServerLinks,
               start_engine: Optional[StartEngine]) -> EngineHandle:
        """Start the engine (returns at once: the engine reports ready over the link, or over
        each link of several front processes')."""


class LocalProcess(EngineHandle):
    """The engine in a spawned child process of the server (the default)."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self.process = process
        self.description = f"pid {process.pid}"

    def watch_exit(self, on_exit: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()

        def exited() -> None:
            loop.remove_reader(self.process.sentinel)
            self.process.join(0)
            on_exit(f"engine process exited with code {self.process.exitcode}")

        loop.add_reader(self.process.sentinel, exited)

    async def stop(self) -> None:
        if not self.process.is_alive():
            return
        await asyncio.to_thread(self.process.join, SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():  # it ignores SIGTERM (engine/process.py)
            logger.warning("engine process did not exit; killing it")
            self.process.kill()
            await asyncio.to_thread(self.process.join)

    async def kill(self) -> None:
        self.process.kill()
        await asyncio.to_thread(self.process.join, SHUTDOWN_TIMEOUT_S)  # reap it


class LocalLauncher(EngineLauncher):
    def launch(self, config: EngineConfig, link: ServerLinks,
               start_engine: Optional[StartEngine]) -> EngineHandle:
        # spawn, not fork: the server process runs gRPC threads and an event loop.
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(config, link, start_engine),
            name="specserve-engine")
        process.start()
        return LocalProcess(process)


class EngineClient:
    def __init__(self, config: EngineConfig, watchdog: EngineWatchdog,
                 start_engine: Optional[StartEngine] = None,
                 launcher: EngineLauncher = LocalLauncher(), kv_events: Optional[str] = None,
                 stream_interval: int = 1):
        """kv_events: an address where the engine also sends its KV-cache events (the
        data-parallel router's; engine/kv_events.py). stream_interval: the detokenizer worker
        holds a sequence's pieces after its first until they carry this many tokens
        (ServerConfig.stream_interval)."""
        self.config = config
        self.kv_events = kv_events
        self.stream_interval = stream_interval
        self.watchdog = watchdog
        self.start_engine = start_engine  # None: the real Engine (see run_engine_process)
        self.launcher = launcher
        self.info: Optional[EngineInfo] = None
        self.tokenizer: Any = None  # the engine's tokenizer (encode/decode), once ready; or None
        self.handle: Optional[EngineHandle] = None
        self._dead_reason: Optional[str] = None
        self._closing = False
        self._ipc_dir = tempfile.mkdtemp(prefix="specserve-ipc-")
        self._zmq = zmq.asyncio.Context()
        self._to_engine = self._zmq.socket(zmq.PUSH)
        self._to_engine.setsockopt(zmq.SNDHWM, 0)  # sends never block the event loop
        self._to_engine.setsockopt(zmq.LINGER, 0)
        # A plain socket: the OutputReader thread reads it.
        self._from_engine = self._zmq.socket(zmq.PULL, socket_class=zmq.Socket)
        self._from_engine.setsockopt(zmq.LINGER, 0)
        self._heartbeats = self._zmq.socket(zmq.PULL)
        self._heartbeats.setsockopt(zmq.LINGER, 0)
        # The detokenizer worker's two sockets (plain ones: the OutputReader thread uses them).
        self._to_text = self._zmq.socket(zmq.PUSH, socket_class=zmq.Socket)
        self._to_text.setsockopt(zmq.SNDHWM, 0)
        self._from_text = self._zmq.socket(zmq.PULL, socket_class=zmq.Socket)
        self._text_worker: Optional[multiprocessing.process.BaseProcess] = None
        self._engine_gone = False  # the engine process is dead: nothing more is sent to it
        self._text_worker_died = False
        self._streams: dict[str, RequestStream] = {}
        # Per live request, its sequences (0 .. n - 1) the engine has not finished yet.
        self._unfinished: dict[str, set[int]] = {}
        self._load_queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count(1)
        self._ready: Optional[asyncio.Future[EngineInfo]] = None
        self._reader: Optional[OutputReader] = None
        self._watcher: Optional[asyncio.Task] = None
        self._death_callbacks: list[Callable[[str], None]] = []
        # Called on the loop with the engine's steps and its load after them (the metrics'
        # step times and load gauges).
        self.on_steps: Optional[Callable[[list, Optional[EngineLoad]], None]] = None
        # Called on the loop with the engine's GrammarHealth whenever it changes.
        self.on_grammar: Optional[Callable[[GrammarHealth], None]] = None

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Bind the sockets and start the engine process (returns at once; see wait_ready)."""
        loop = asyncio.get_running_loop()
        sockets = (self._to_engine, self._from_engine, self._heartbeats)
        host = self.launcher.bind_host
        if host is None:
            addresses = [f"ipc://{os.path.join(self._ipc_dir, name)}"
                         for name in ("requests", "outputs", "heartbeats")]
            for sock, address in zip(sockets, addresses):
                sock.bind(address)
        else:
            addresses = [f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
                         for sock in sockets]
        link = ServerLink(*addresses, heartbeat_interval_s=self.watchdog.heartbeat_interval_s,
                          kv_events=self.kv_events)
        self._ready = loop.create_future()
        self.handle = self.launcher.launch(self.config, link, self.start_engine)
        self.handle.watch_exit(self._on_process_exit)
        self._start_text_worker(loop)
        self._reader = OutputReader(self._from_engine, self._to_text, self._from_text, loop,
                                    self._on_routed)
        self._reader.start()

    def _start_text_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        """Spawn the detokenizer worker (it gets the tokenizer once the engine is ready). If it
        dies the server stops serving for good, as for a dead engine (docs/architecture.md)."""
        link = DetokenizerLink(*(f"ipc://{os.path.join(self._ipc_dir, name)}"
                                 for name in ("text-in", "text-out")))
        self._to_text.connect(link.inbox)  # the worker binds it (see DetokenizerLink)
        self._from_text.bind(link.outbox)
        worker = multiprocessing.get_context("spawn").Process(
            target=run_detokenizer, args=(link,), name="specserve-detokenizer", daemon=True)
        worker.start()
        self._text_worker = worker

        def exited() -> None:
            loop.remove_reader(worker.sentinel)
            worker.join(0)
            if not self._closing:
                self._on_text_worker_exit(f"the detokenizer worker (pid {worker.pid}) exited "
                                          f"with code {worker.exitcode}")

        loop.add_reader(worker.sentinel, exited)

    @property
    def text_worker_pid(self) -> Optional[int]:
        return self._text_worker.pid if self._text_worker is not None else None

    async def wait_ready(self) -> EngineInfo:
        """The engine's info once it is loaded and warm; EngineUnavailable if it died first."""
        return await asyncio.shield(self._ready)

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call callback(reason) if the engine process exits unexpectedly."""
        self._death_callbacks.append(callback)

    async def shutdown(self) -> None:
        """Ask the engine to stop, wait for it (then terminate/kill), and release the sockets."""
        self._closing = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self.handle is not None:
            self._send(ipc.ServerToEngine(shutdown=ipc.Shutdown()), quiet=True)
            await self.handle.stop()
        self._fail_all(EngineUnavailable("the server is shutting down"))
        if self._reader is not None:
            self._reader.command(("stop",))
            self._reader.stop()
            await asyncio.to_thread(self._reader.join)  # it closes its sockets
        else:
            for sock in (self._from_engine, self._to_text, self._from_text):
                sock.close(linger=0)
        worker = self._text_worker
        if worker is not None and worker.is_alive():
            await asyncio.to_thread(worker.join, 2.0)
            if worker.is_alive():
                worker.kill()
                await asyncio.to_thread(worker.join, SHUTDOWN_TIMEOUT_S)
        self._to_engine.close()
        self._heartbeats.close()
        self._zmq.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # --- requests ------------------------------------------------------------------------
    def submit(self, rid: str, request: ValidatedRequest, report_spec: bool) -> RequestStream:
        """Send a request to the engine; the detokenizer worker turns the outputs of its
        sampling.n sequences into chunks (one OutputStream per sequence there), which arrive (or
        a final error) on the returned stream. The stream is dropped after every sequence's
        finished output or an error."""
        self.check_available()
        sampling = request.sampling
        stream = RequestStream(sampling.n)
        self._streams[rid] = stream
        self._unfinished[rid] = set(range(sampling.n))
        # Queued before the engine can answer: the worker opens it before its first output.
        self._reader.command(("open", rid, request, report_spec))
        self._send(ipc.ServerToEngine(add=add_request_to_proto(rid, request.prompt_token_ids,
                                                               sampling)))
        return stream

    def abort(self, rid: str, index: Optional[int] = None) -> None:
        """Stop a request, or only its sequence `index`, and free its KV; a no-op once it
        finished or the engine is gone. Outputs of the other sequences keep arriving."""
        unfinished = self._unfinished.get(rid)
        if unfinished is None or (index is not None and index not in unfinished):
            return
        if index is None or unfinished == {index}:
            self._streams.pop(rid, None)
            self._unfinished.pop(rid, None)
            self._reader.command(("close", rid))
        else:
            unfinished.discard(index)
        if not self._engine_gone:
            self._send(ipc.ServerToEngine(abort=ipc.AbortRequest(rid=rid, index=index)), quiet=True)

    async def load(self, flush_prefix_cache: bool = False) -> EngineLoad:
        """The engine's load, taken between steps (after flushing its prefix cache if asked);
        also after the detokenizer worker died (the engine still runs)."""
        if self._engine_gone or self._dead_reason is None:
            self.check_available()
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._load_queries[query_id] = future
        try:
            self._send(ipc.ServerToEngine(load_query=ipc.LoadQuery(
                query_id=query_id, flush_prefix_cache=flush_prefix_cache)))
            return await asyncio.wait_for(future, LOAD_QUERY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"the engine did not report its load within "
                                    f"{LOAD_QUERY_TIMEOUT_S:.0f} s") from None
        finally:
            self._load_queries.pop(query_id, None)

    def check_available(self) -> None:
        """Raise EngineUnavailable (saying why) unless the engine takes requests now."""
        if self._dead_reason is not None:
            raise EngineUnavailable(self._dead_reason_message())
        if self._closing:
            raise EngineUnavailable("the server is shutting down")
        if self.info is None:
            raise EngineUnavailable("the engine is still starting (loading and warming up)")

    # --- internals -----------------------------------------------------------------------

    def _send(self, message: ipc.ServerToEngine, quiet: bool = False) -> None:
        # A non-blocking send on an asyncio socket returns a future that is already done; a
        # failure (no engine connected) is on it, not raised.
        error = self._to_engine.send(message.SerializeToString(), flags=zmq.NOBLOCK).exception()
        if error is not None and not quiet:
            raise EngineUnavailable(f"cannot reach the engine process: {error}") from error

    def _on_routed(self, routed: list[Routed]) -> None:
        """What the reader thread read since the last call, in order (on the loop)."""
        now = time.perf_counter()
        for item in routed:
            if isinstance(item, TextUpdate):
                self._on_update(item, now)
            elif isinstance(item, EngineSteps):
                if self.on_steps is not None:
                    self.on_steps(item.steps, item.load)
            else:
                self._on_message(item)

    def _on_update(self, update: TextUpdate, now: float) -> None:
        stream = self._streams.get(update.rid)
        if stream is None:  # aborted meanwhile
            return
        if update.error is not None:  # the request fails: its other sequences are aborted
            stream.fail(SequenceFailed(update.index, update.error))
            self.abort(update.rid)
            return
        if update.engine_finished:
            unfinished = self._unfinished[update.rid]
            unfinished.discard(update.index)
            if not unfinished:
                del self._streams[update.rid], self._unfinished[update.rid]
        elif update.stopped_by_stop_string:
            # The engine has not finished the sequence: it stops it now (alone when there are
            # others, which go on).
            self.abort(update.rid, update.index if stream.n > 1 else None)
        stream.deliver(update.index, update.piece, EngineProgress(*update.progress), now,
                       update.stamps)

    def _on_message(self, message: ipc.EngineToServer) -> None:
        kind = message.WhichOneof("kind")
        if kind == "rejected":
            stream = self._streams.pop(message.rejected.rid, None)
            if self._unfinished.pop(message.rejected.rid, None) is not None:
                self._reader.command(("close", message.rejected.rid))
            if stream is not None:
                stream.fail(RequestRejected(message.rejected.message))
        elif kind == "load":
            future = self._load_queries.get(message.load.query_id)
            if future is not None and not future.done():
                future.set_result(load_from_proto(message.load.load))
        elif kind == "ready":
            self._on_ready(message.ready)
        elif kind == "grammar":
            if self.on_grammar is not None:
                self.on_grammar(grammar_health_from_proto(message.grammar))
        elif kind == "failed":
            error, _, trace = message.failed.message.partition("\n")
            self._engine_gone = True
            if self.info is None:
                # At start-up, as a rule a configuration the engine cannot serve (a checkpoint,
                # device or option): its one line says it, the traceback is for --log-level DEBUG.
                logger.debug("the engine failed to start:\n%s", trace)
                self._mark_dead(error)
            else:  # a bug: its traceback belongs in the log
                logger.error("engine failed: %s%s", error, f"\n{trace}" if trace else "")
                self._mark_dead(f"engine failed: {error}")

    def _on_ready(self, ready: ipc.EngineReady) -> None:
        self._reader.command(("init", ready.tokenizer_pickle, self.stream_interval))
        self.tokenizer = pickle.loads(ready.tokenizer_pickle) if ready.tokenizer_pickle else None
        self.info = info_from_proto(ready.info)
        if not self._ready.done():
            self._ready.set_result(self.info)
        self.watchdog.arm()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Feed the watchdog the engine's heartbeats; kill the engine if the watchdog trips."""
        while self._dead_reason is None:
            await asyncio.sleep(self.watchdog.heartbeat_interval_s)
            # Every beat that has arrived is read here, just before the check, rather than by a
            # reader task: a check then never judges the engine on beats still in the socket
            # (e.g. after a busy stretch of this event loop).
            while True:
                try:
                    beat = ipc.Heartbeat.FromString(await self._heartbeats.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                self.watchdog.on_heartbeat(beat.loop_iterations)
            reason = self.watchdog.check()
            if reason is not None:
                self._engine_gone = True
                self._mark_dead(reason)
                # A frozen or stuck engine may hold the GPU and could resume and act on requests
                # that the server has already failed; it must be gone for good.
                logger.error("killing the engine process (%s)", self.handle.description)
                await self.handle.kill()

    def _on_process_exit(self, reason: str) -> None:
        if self._closing:
            return
        self._engine_gone = True
        if self.info is None:
            # An engine that fails to start reports why before it exits, but the report may
            # still be on its way through the reader thread: it, not the exit code, says why.
            asyncio.get_running_loop().call_later(EXIT_REPORT_GRACE_S, self._mark_dead, reason)
        else:
            self._mark_dead(reason)

    def _on_text_worker_exit(self, reason: str) -> None:
        """The detokenizer worker died: no request's output can be streamed any more. Every
        live request is aborted in the engine (its KV freed) and ends with EngineUnavailable;
        the server stops serving for good, as for a dead engine."""
        if not self._engine_gone:
            for rid in list(self._unfinished):
                self._send(ipc.ServerToEngine(abort=ipc.AbortRequest(rid=rid)), quiet=True)
        self._text_worker_died = True
        self._mark_dead(reason)

    def _dead_reason_message(self) -> str:
        if self._text_worker_died:
            return f"the server cannot stream outputs: {self._dead_reason}"
        return f"the engine process is gone: {self._dead_reason}"

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is not None or self._closing:
            return
        self._dead_reason = reason
        if self._ready is not None and not self._ready.done():
            # Never ready: the start-up failure, said once by whoever waits (app.py).
            self._ready.set_exception(EngineUnavailable(reason))
        else:
            logger.error("%s", reason)
        self._fail_all(EngineUnavailable(self._dead_reason_message()))
        for callback in self._death_callbacks:
            callback(reason)

    def _fail_all(self, error: EngineUnavailable) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        for rid, stream in self._streams.items():
            stream.fail(error)
            if self._reader is not None:
                self._reader.command(("close", rid))
        self._streams.clear()
        self._unfinished.clear()
        for future in self._load_queries.values():
            if not future.done():
                future.set_exception(error)
