"""Engine process entry: IPC in, scheduler loop, IPC out.

The gRPC server (specserve.server.engine_client) starts `run_engine_process` in a spawned child.
Two ZeroMQ sockets connect it to the server: it PULLs ServerToEngine messages (add, abort, load
query, shutdown) and PUSHes EngineToServer messages (ready, one columnar BatchOutput per scheduler step,
rejections, load reports). The loop drains incoming messages without blocking while there is
work, runs one `engine.step()`, and blocks on the socket only when nothing is left to run.
A third socket carries Heartbeats from a thread of their own, for the server's watchdog. With
`kv_events_endpoint` set, or the data-parallel router's address in the ServerLink, the prefix
cache's block events of each iteration go out as one batch (engine/kv_events.py).

Several servers may share one engine (the front processes of a data-parallel server,
server/cluster/front_processes.py): the engine then gets one ServerLink per front and connects
its sockets to each. A request's outputs, its rejection and a load report go back on the link
it came from; ready, failures, grammar health and every step's StepStats and load go to every
link (each front's metrics see each engine whole); heartbeats and KV-cache events to all. A
front's Shutdown closes its link (its requests still running are aborted, their KV freed) and
the engine stops when every link is closed: with one link, exactly as before.
"""
from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import zmq

from specserve.engine.config import EngineConfig, SamplingParams
from specserve.engine.host_pauses import freeze_startup_heap
from specserve.engine.kv_events import KVEventPublisher
from specserve.engine.progress import progress
from specserve.engine.wire import (encode_batch, grammar_health_to_proto, info_to_proto, load_to_proto,
                                   sampling_from_add_request)
from specserve.proto import engine_ipc_pb2 as ipc

logger = logging.getLogger("specserve.engine.process")

# Warm-up prompt lengths on a GPU: powers of two up to this (longer prompts use the kernels'
# largest tiles, which these already compile).
WARMUP_MAX_PROMPT = 256
# Then batches of prompts (count, longest length; each shorter by one than the one before).
WARMUP_BATCHES = ((3, 7), (16, 40), (64, 160))
# With mixed steps: prompts of these lengths arriving one a step while a request decodes (on a
# GPU; the CPU's first three). A mixed step runs its chunks' draft side eagerly around the
# replayed target forward, whose kernels specialise on token counts as above (1, a multiple of
# 16, other) and their powers of two: on an H100 a 1-token chunk (a prompt cached but its last
# token) compiled for 0.8 s in the middle of serving (engine/host_pauses.py).
MIXED_WARMUP_PROMPTS = (1, 2, 3, 5, 9, 16, 17, 32, 33, 64, 65, 129, 256)
# How long start-up waits for the grammar process to start and compile its warm-up schema.
GRAMMAR_WARMUP_TIMEOUT_S = 120.0
# How often an idle engine wakes up to check that the server process is still there. The main
# loop thus completes an iteration at least this often when idle (server/ops/watchdog.py relies on it).
IDLE_POLL_MS = 500
# How long the heartbeat thread gives the engine to fail and shut down on its own once a
# tensor-parallel rank died, before it ends the process: a step waiting for the dead rank in a
# collective (NCCL, or the custom all-reduce spinning on its peer's flag) never returns, nor
# does a CUDA call of the teardown behind it, and the ranks this one spawned exit only once it
# does (engine/tp.py).
RANK_FAILURE_EXIT_S = 10.0


@dataclass(frozen=True)
class ServerLink:
    """Where the engine process meets the server: the addresses the server bound (ipc:// paths;
    tcp:// on its node's IP for an engine that may run on another host)."""

    requests: str
    outputs: str
    heartbeats: str
    heartbeat_interval_s: float
    # Where the server's router reads this engine's KV-cache events (a SUB socket it bound;
    # data-parallel replicas), or None.
    kv_events: Optional[str] = None


# One server, or several front processes sharing the engine (one link each, in front order).
ServerLinks = Union[ServerLink, tuple[ServerLink, ...]]


def server_links(links: ServerLinks) -> tuple[ServerLink, ...]:
    return (links,) if isinstance(links, ServerLink) else tuple(links)


# Builds what the loop drives from the config: an `Engine`, or for benchmarks of the server
# alone a stand-in with the same methods (bench/frontend.py); a picklable top-level function.
StartEngine = Callable[[EngineConfig], Any]


def run_engine_process(config: EngineConfig, link: ServerLinks,
                       start_engine: Optional[StartEngine] = None) -> None:
    """Child-process entry: start the engine, report ready, serve IPC until told to stop (by
    every link's server, when there are several).

    Exits with status 1 (after sending EngineFailed) if the engine cannot start or a step fails.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    # Ctrl-C, and SIGTERM from systemd or `kill -- -PGID`, reach the whole process group; the
    # server decides when the engine stops (after draining), so it must not die on them first.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    links = server_links(link)
    context = zmq.Context()
    requests, outputs = [], []
    for each in links:
        requests.append(context.socket(zmq.PULL))
        requests[-1].connect(each.requests)
        outputs.append(context.socket(zmq.PUSH))
        outputs[-1].setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
        outputs[-1].setsockopt(zmq.LINGER, 2000)  # let the last messages (e.g. EngineFailed) go out
        outputs[-1].connect(each.outputs)
    server_pid = os.getppid()
    engine = heartbeat = kv_events = None
    try:
        # Before the weights load: a bad or busy endpoint fails the start at once.
        kv_events = kv_event_publisher(config, context,
                                       [each.kv_events for each in links if each.kv_events])
        engine = (start_engine or start_warm_engine)(config)
        freeze_startup_heap()  # start-up's objects out of the collector's walks (host_pauses.py)
        if kv_events is not None:
            engine.record_kv_events()  # the warm-up's cached blocks are the first batch
        loop = _EngineLoop(engine, requests, outputs, server_pid, kv_events)
        # Watched from the moment the server hears "ready", so beating starts before that.
        heartbeat = HeartbeatThread(context, links, loop)
        heartbeat.start()
        loop.report_grammar()  # warm already (start_warm_engine): SERVING together with the engine
        loop.broadcast(ipc.EngineToServer(ready=_ready_message(engine)))
        loop.run()
    except Exception as e:
        # The server logs it (once: the traceback too when the engine had been serving).
        failed = ipc.EngineFailed(message=f"{one_line(e)}\n{traceback.format_exc()}")
        for sock in outputs:
            sock.send(ipc.EngineToServer(failed=failed).SerializeToString())
        raise SystemExit(1)
    finally:
        if heartbeat is not None:
            heartbeat.stop()  # before context.term(), which waits for every socket to close
        if engine is not None:
            engine.shutdown()
        if kv_events is not None:
            kv_events.close()
        for sock in requests:
            sock.close(linger=0)
        for sock in outputs:
            sock.close()
        context.term()


def kv_event_publisher(config: EngineConfig, context: zmq.Context,
                       servers: Sequence[str] = ()) -> Optional[KVEventPublisher]:
    """The KV-event publisher the config (and the servers' routers, at `servers`) asks for, its
    sockets bound or connected; None when neither does."""
    if config.kv_events_endpoint is None and not servers:
        return None
    return KVEventPublisher(context, config.kv_events_endpoint, config.kv_events_replay_endpoint,
                            config.kv_events_topic, servers)


def one_line(error: BaseException) -> str:
    """An error as one line: a ValueError's message alone (ours start with the field they
    refuse), others after their type (FileNotFoundError, torch.OutOfMemoryError, ...)."""
    text = " ".join(str(error).split()) or "(no message)"
    return text if type(error) is ValueError else f"{type(error).__name__}: {text}"


def start_warm_engine(config: EngineConfig, tp_init_method: Optional[str] = None):
    """The real Engine, warmed up; tp_init_method as for Engine (the default StartEngine)."""
    # Imported here so that importing this module (e.g. by the server) does not load torch.
    from specserve.engine import Engine

    engine = Engine(config, tp_init_method)
    engine.warm_grammar(timeout=0)  # starts the grammar process: it warms up beside the model
    # Short generations before reporting ready, so that the first real request finds every
    # lazily built piece (kernels, graphs, allocator) in place. On a GPU the attention kernels
    # specialise on their tile height (a prompt's tokens x the query heads of a KV group), so
    # one prompt length per power of two up to WARMUP_MAX_PROMPT compiles them all (a request
    # of a new length otherwise paid about a second).
    longest = WARMUP_MAX_PROMPT if engine.core.device.type == "cuda" else 4
    lengths = [n for n in (1 << i for i in range(longest.bit_length())) if n < engine.max_context_len]
    logger.info("warming up: prompts of %s tokens%s, greedy and sampled (the first forwards "
                "compile and allocate)", ", ".join(map(str, lengths)),
                ", then batches" if engine.core.device.type == "cuda" else "")
    vocab = engine.info.vocab_size
    # Both paths of an extend: greedy batches that end their prompts replay the captured extends
    # (runtime/captured_extend.py), the rest (sampled, a chunk inside a prompt, more than the
    # buckets hold) run eagerly, whose kernels specialise as above. Each pass on tokens of its
    # own, so that the prefix cache does not turn its prompts into cached tails.
    passes = ((0, SamplingParams(max_new_tokens=2, temperature=0.0)),
              (1, SamplingParams(max_new_tokens=2, temperature=1.0, seed=0)))
    # (prompts, sampling) of each warm-up generation, run in this order.
    runs = [([[(i + 7 * offset) % vocab for i in range(n)]], params)
            for offset, params in passes for n in lengths]
    if engine.core.device.type == "cuda":
        # Batched prefills, as concurrent arrivals make them: an eager extend's kernels take
        # the batch's request and token counts as arguments, which Triton specialises (1, a
        # multiple of 16, other), so single prompts leave variants for the first waves of
        # users to compile (E24: TTFT p99 1.8 s at 64 streams). Distinct first tokens: no
        # prompt reuses another's cached prefix.
        for offset, params in passes:
            for batch, length in WARMUP_BATCHES:
                batch = min(batch, engine.config.max_running_requests)
                length = min(length, engine.max_context_len - 4)
                runs.append(([[(j * 7919 + i + 104729 * offset) % vocab
                               for i in range(length - j % length)] for j in range(batch)], params))
    for prompts, params in progress(runs, len(runs), "warming up", "generations"):
        engine.generate(prompt_token_ids=prompts, sampling=params)
    if engine.config.mixed_steps:
        lengths = MIXED_WARMUP_PROMPTS if engine.core.device.type == "cuda" else MIXED_WARMUP_PROMPTS[:3]
        for offset, params in passes:
            _warm_mixed_steps(engine, [n for n in lengths if n < engine.max_context_len - 4], params,
                              first_token=31 * (offset + 1))
    if engine.warm_grammar(GRAMMAR_WARMUP_TIMEOUT_S) is False:
        logger.warning("the grammar service did not warm up within %.0f s; structured outputs "
                       "wait for it", GRAMMAR_WARMUP_TIMEOUT_S)
    engine.take_step_stats()  # the warm-up's steps are no one's
    return engine


def _warm_mixed_steps(engine, lengths: list[int], params: SamplingParams, first_token: int) -> None:
    """One request decoding, and a prompt of each of `lengths` arriving once the one before has
    its first token, so that mixed steps carry chunks of those sizes one at a time
    (MIXED_WARMUP_PROMPTS; distinct tokens, so that no prompt is a cached prefix of another),
    then the longest again with one more token: a 1-token chunk behind a cached prefix."""
    vocab = engine.info.vocab_size
    decoding = SamplingParams(max_new_tokens=8 * len(lengths) + 16, temperature=params.temperature,
                              seed=params.seed, ignore_eos=True)
    engine.add_request(f"warm-mixed-{first_token}", [first_token % vocab] * 4, decoding)
    engine.step()
    prompts = [[(first_token + 7919 * (i + 1) + j) % vocab for j in range(n)]
               for i, n in enumerate(lengths)]
    for i, prompt in enumerate(prompts + [prompts[-1] + [first_token % vocab]]):
        rid = f"warm-mixed-{first_token}-{i}"
        engine.add_request(rid, prompt, params)
        while not any(out.rid == rid for out in engine.step()):
            pass
    while engine.has_unfinished():
        engine.step()


def _ready_message(engine) -> ipc.EngineReady:
    tokenizer = engine.tokenizer  # None when the model folder has no tokenizer.json
    return ipc.EngineReady(info=info_to_proto(engine.info),
                           tokenizer_pickle=pickle.dumps(tokenizer) if tokenizer is not None else b"")


class _EngineLoop:
    def __init__(self, engine, requests: Sequence[zmq.Socket], outputs: Sequence[zmq.Socket],
                 server_pid: int, kv_events: Optional[KVEventPublisher] = None):
        """requests, outputs: one socket each per server link, in the same order."""
        self.engine = engine
        self.kv_events = kv_events
        # vLLM's `medium` of the blocks: where the KV pool lives.
        self._kv_medium = (None if kv_events is None
                           else "GPU" if engine.core.device.type == "cuda" else "CPU")
        self.requests = list(requests)
        self.outputs = list(outputs)
        self.open_links = set(range(len(self.requests)))  # until each link's Shutdown
        self._poller = zmq.Poller()
        for sock in self.requests:
            self._poller.register(sock, zmq.POLLIN)
        self.server_pid = server_pid
        # Requests added and not yet finished, with their unfinished sequences: aborts for
        # anything else are dropped, since the server may abort a request (or a sequence) that
        # finished while the abort was in flight.
        self.live: dict[str, set[int]] = {}
        self.link_of: dict[str, int] = {}  # a live request's link: its outputs go back there
        # Read by the heartbeat thread (an int assignment is atomic): stops moving only while
        # an iteration, i.e. a step, does not return.
        self.iterations = 0
        self._grammar_health = None   # as last sent to the server

    def run(self) -> None:
        while os.getppid() == self.server_pid:
            self.engine.check_ranks()  # a dead tp rank fails the engine at once, idle or not
            for link, message in self._receive(block=not self.engine.has_unfinished()):
                if message.WhichOneof("kind") == "shutdown":
                    self._close_link(link)
                    if not self.open_links:
                        return
                elif link in self.open_links:
                    self._handle(link, message)
            if self.engine.has_unfinished():
                self._step()
            if self.kv_events is not None:  # the step's changes, and a flush's between steps
                self.kv_events.publish(self.engine.take_kv_events(), self._kv_medium)
            self.report_grammar()
            self.iterations += 1
        logger.warning("server process %d is gone; engine exiting", self.server_pid)

    def _receive(self, block: bool) -> list[tuple[int, ipc.ServerToEngine]]:
        if block and not self._poller.poll(IDLE_POLL_MS):
            return []
        messages = []
        for link, sock in enumerate(self.requests):
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                messages.append((link, ipc.ServerToEngine.FromString(data)))
        return messages

    def _close_link(self, link: int) -> None:
        """The link's server is done with this engine: what it still runs is no one's."""
        self.open_links.discard(link)
        if not self.open_links:
            return  # the engine stops; its shutdown frees everything
        for rid in [rid for rid, owner in self.link_of.items() if owner == link]:
            self.engine.abort(rid, None)
            del self.live[rid], self.link_of[rid]

    def _handle(self, link: int, message: ipc.ServerToEngine) -> None:
        kind = message.WhichOneof("kind")
        if kind == "add":
            self._add(link, message.add)
        elif kind == "abort":
            abort = message.abort
            index = abort.index if abort.HasField("index") else None
            sequences = self.live.get(abort.rid, ())
            if sequences and (index is None or index in sequences):
                self.engine.abort(abort.rid, index)
        elif kind == "load_query":
            if message.load_query.flush_prefix_cache:
                self.engine.flush_prefix_cache()
            self._send(link, ipc.EngineToServer(load=self._load_report(message.load_query.query_id)))

    def _add(self, link: int, add: ipc.AddRequest) -> None:
        try:
            self.engine.add_request(add.rid, list(add.prompt_token_ids),
                                    sampling_from_add_request(add))
        except ValueError as e:  # the engine names the field; the server maps it to INVALID_ARGUMENT
            self._send(link, ipc.EngineToServer(rejected=ipc.RequestRejected(rid=add.rid,
                                                                             message=str(e))))
            return
        self.live[add.rid] = set(range(add.sampling.n))
        self.link_of[add.rid] = link

    def _step(self) -> None:
        step_outputs = self.engine.step()
        steps = self.engine.take_step_stats()  # the server's step-time metrics
        if not step_outputs and not steps:
            return
        by_link: dict[int, list] = collections.defaultdict(list)
        for out in step_outputs:
            link = self.link_of.get(out.rid)
            if link is None:  # its link closed in this step's flight
                continue
            by_link[link].append(out)
            if out.finished:
                sequences = self.live[out.rid]
                sequences.discard(out.index)
                if not sequences:
                    del self.live[out.rid], self.link_of[out.rid]
        load = self.engine.load()
        for link in sorted(self.open_links):  # every link gets the steps, each its own outputs
            if by_link[link] or steps:
                self._send(link, ipc.EngineToServer(batch=encode_batch(by_link[link], steps, load)))

    def report_grammar(self) -> None:
        """Tell the server when the grammar service's state changed (idle, within IDLE_POLL_MS;
        restarting it, if it died, happens in the same call)."""
        health = self.engine.grammar_health()
        if health != self._grammar_health and health is not None:
            self._grammar_health = health
            self.broadcast(ipc.EngineToServer(grammar=grammar_health_to_proto(health)))

    def _load_report(self, query_id: int) -> ipc.LoadReport:
        return ipc.LoadReport(query_id=query_id, load=load_to_proto(self.engine.load()))

    def _send(self, link: int, message: ipc.EngineToServer) -> None:
        self.outputs[link].send(message.SerializeToString())

    def broadcast(self, message: ipc.EngineToServer) -> None:
        """To every link still open."""
        data = message.SerializeToString()
        for link in sorted(self.open_links):
            self.outputs[link].send(data)


class HeartbeatThread(threading.Thread):
    """Sends a Heartbeat with the main loop's iteration count every heartbeat interval.

    A thread, so that beats go on during a long step and stop only when the whole process does
    (the server's watchdog tells the two apart; see server/ops/watchdog.py), or when a
    tensor-parallel rank died. It has a socket of its own: ZeroMQ sockets must not be shared
    between threads.
    """

    def __init__(self, context: zmq.Context, link: ServerLinks, loop: _EngineLoop,
                 exit_grace_s: float = RANK_FAILURE_EXIT_S,
                 exit_process: Callable[[int], Any] = os._exit):
        super().__init__(name="specserve-heartbeat", daemon=True)
        self.context = context
        self.links = server_links(link)  # every server beats are sent to
        self.interval_s = self.links[0].heartbeat_interval_s
        self.loop = loop
        self.exit_grace_s = exit_grace_s
        self.exit_process = exit_process
        self._stopping = threading.Event()

    def run(self) -> None:
        beats = []
        for link in self.links:
            beats.append(self.context.socket(zmq.PUSH))
            beats[-1].setsockopt(zmq.LINGER, 0)
            beats[-1].setsockopt(zmq.SNDHWM, 4)  # only the latest beats matter to a slow reader
            beats[-1].connect(link.heartbeats)
        try:
            failure = self._beat(beats)
        finally:
            for sock in beats:  # before the grace below: context.term() waits for every socket
                sock.close()
        if failure is None:
            return
        # The loop raises (EngineFailed) unless its step waits for the dead rank in a
        # collective that never returns (NCCL, or the custom all-reduce spinning on the dead
        # peer's flag, which also hangs any later CUDA call of the teardown): the missing beats
        # make the server's watchdog fail the engine within its heartbeat timeout, and this
        # thread ends the process after the grace unless it ended first (a daemon thread).
        logger.error("%s: heartbeats stop", failure)
        time.sleep(self.exit_grace_s)
        logger.error("the engine is still waiting for the dead rank after %.0f s: its process exits",
                     self.exit_grace_s)
        self.exit_process(1)

    def _beat(self, beats: list[zmq.Socket]) -> Optional[str]:
        """Beat until stopped (None) or a tensor-parallel rank died (why)."""
        while True:
            failure = self.loop.engine.rank_failure()
            if failure is not None:
                return failure
            beat = ipc.Heartbeat(loop_iterations=self.loop.iterations).SerializeToString()
            for sock in beats:
                try:
                    sock.send(beat, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the server is not reading: a lost beat is no loss
            if self._stopping.wait(self.interval_s):
                return None

    def stop(self) -> None:
        """Stop beating; a thread in its grace after a rank died is left to it (its socket is
        closed already)."""
        self._stopping.set()
        self.join(timeout=self.interval_s + 1.0)


