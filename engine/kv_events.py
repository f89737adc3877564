"""Publishing KV-cache events over ZeroMQ in vLLM's wire format (`--kv-events-endpoint`).

What is published: the prefix cache's block events (kvcache/block_events.py), one batch per
engine-loop iteration that had any. The wire, as vLLM's `ZmqEventPublisher` and
`KVEventBatch` (docs/deployment.md, "KV events", says where we differ):

* PUB socket, one multipart message per batch: [topic, sequence (8 bytes, big-endian,
  from 0, +1 per batch), payload]. The endpoint is bound when its host is a wildcard
  (`tcp://*:5557`, `tcp://[::]:5557`) or it is ipc://, and connected to otherwise (an indexer
  that binds, as llm-d's central mode does): vLLM's rule.
* payload: a msgpack array [timestamp (float seconds since the epoch), [event, ...]], each event
  an array led by its tag: ["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"].
  Hashes are unsigned 64-bit integers; lora_id is nil.
* Replay (`--kv-events-replay-endpoint`, always bound): a ROUTER socket. A request [b"", N]
  from a DEALER socket (N: a sequence number, 8 bytes, big-endian; a REQ socket adds the empty
  frame itself but takes only the first answer) is answered with [b"", sequence, payload] for
  every buffered batch from N on, then [b"", -1 (8 bytes, signed), b""]. The last
  REPLAY_BUFFER_BATCHES batches are buffered.

The engine loop only encodes a batch and queues it on an inproc socket (never blocking); a
thread of the publisher numbers, sends and buffers it and answers replays, so neither a slow
subscriber nor a long replay holds a step.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Optional, Sequence

import msgpack
import zmq

from specserve.engine.config import check_zmq_endpoint
from specserve.engine.kvcache.block_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger("specserve.engine.kv_events")

# Batches kept for replay (vLLM's default buffer_steps).
REPLAY_BUFFER_BATCHES = 10_000
# Batches the PUB socket queues per subscriber before it drops (vLLM's default hwm).
PUB_HIGH_WATER_MARK = 100_000
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` (else it connects to it): vLLM's rule."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """A payload's timestamp and events (the inverse of encode_batch; medium and lora_id are
    dropped)."""
    timestamp, wire = msgpack.unpackb(payload)
    events: list[KVEvent] = []
    for event in wire:
        if event[0] == "BlockStored":
            events.append(BlockStored(tuple(event[1]), event[2], tuple(event[3]), event[4]))
        elif event[0] == "BlockRemoved":
            events.append(BlockRemoved(tuple(event[1])))
        elif event[0] == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV-cache event {event[0]!r}")
    return timestamp, events


def encode_batch(events: Sequence[KVEvent], medium: Optional[str], timestamp: float) -> bytes:
    """One KVEventBatch payload (msgpack), as vLLM encodes it."""
    wire = []
    for event in events:
        if isinstance(event, BlockStored):
            wire.append(["BlockStored", list(event.block_hashes), event.parent_block_hash,
                         list(event.token_ids), event.block_size, None, medium])
        elif isinstance(event, BlockRemoved):
            wire.append(["BlockRemoved", list(event.block_hashes), medium])
        elif isinstance(event, AllBlocksCleared):
            wire.append(["AllBlocksCleared"])
        else:
            raise TypeError(f"not a KV-cache event: {event!r}")
    return msgpack.packb([timestamp, wire])


class KVEventPublisher:
    """The sockets are made (bound or connected) in the constructor, so that a bad or busy
    endpoint fails the engine's start with ValueError naming the field; then a thread owns
    them. `publish` is called from the engine loop's thread only."""

    def __init__(self, context: zmq.Context, endpoint: Optional[str],
                 replay_endpoint: Optional[str] = None, topic: str = "",
                 servers: Sequence[str] = (), buffer_batches: int = REPLAY_BUFFER_BATCHES):
        """endpoint: the user's (--kv-events-endpoint); servers: addresses the serving processes
        bound for their own routers (data-parallel replicas, one per front process), connected
        to as well."""
        self._topic = topic.encode()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._sequence = itertools.count()
        sockets: list[zmq.Socket] = []
        try:
            self._pub = _socket(context, zmq.PUB, sockets)
            self._pub.setsockopt(zmq.SNDHWM, PUB_HIGH_WATER_MARK)
            if endpoint is not None:
                _attach(self._pub, "kv_events_endpoint", endpoint, bind=binds(endpoint))
            for server in servers:
                self._pub.connect(server)
            self._replay = None
            if replay_endpoint is not None:
                self._replay = _socket(context, zmq.ROUTER, sockets)
                self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay is sent whole
                _attach(self._replay, "kv_events_replay_endpoint", replay_endpoint, bind=True)
            self._inbox = _socket(context, zmq.PULL, sockets)
            inproc = f"inproc://specserve-kv-events-{id(self)}"
            self._inbox.bind(inproc)
            self._outbox = _socket(context, zmq.PUSH, sockets)
            self._outbox.setsockopt(zmq.SNDHWM, 0)  # the thread keeps up; never drop a batch
            self._outbox.connect(inproc)
        except BaseException:
            for s in sockets:
                s.close(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="specserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent], medium: Optional[str] = None) -> None:
        """Queue one batch (nothing when `events` is empty); never blocks. `medium`: vLLM's
        name of where the blocks live ("GPU"), or None."""
        if events:
            self._outbox.send(encode_batch(events, medium, time.time()))

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sockets."""
        self._outbox.send(b"")  # an empty payload is the thread's stop signal
        self._thread.join()
        self._outbox.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                # Every batch queued so far first, so that a replay covers what was published
                # before it was asked for.
                if self._inbox in ready and not self._send_queued():
                    return
                if self._replay is not None and self._replay in ready:
                    self._answer_replay(self._replay.recv_multipart())
        finally:
            for s in (self._pub, self._replay, self._inbox):
                if s is not None:
                    s.close(linger=0)

    def _send_queued(self) -> bool:
        """Number, send and buffer the queued batches; False once told to stop."""
        while True:
            try:
                payload = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if not payload:
                return False
            sequence = next(self._sequence)
            # PUB never blocks: past the high-water mark a slow subscriber loses batches, sees
            # the gap in the sequence numbers and asks for a replay.
            self._pub.send_multipart([self._topic, sequence.to_bytes(8, "big"), payload])
            self._buffer.append((sequence, payload))

    def _answer_replay(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("kv events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for sequence, payload in self._buffer:
            if sequence >= start:
                self._replay.send_multipart([client, b"", sequence.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_OF_REPLAY, b""])


def _socket(context: zmq.Context, kind: int, made: list[zmq.Socket]) -> zmq.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    made.append(socket)
    return socket


def _attach(socket: zmq.Socket, field_name: str, endpoint: str, bind: bool) -> None:
    check_zmq_endpoint(field_name, endpoint)
    try:
        socket.bind(endpoint) if bind else socket.connect(endpoint)
    except zmq.ZMQError as e:
        flag = "--" + field_name.replace("_", "-")
        raise ValueError(f"{field_name} ({flag}): cannot {'bind' if bind else 'connect to'} "
                         f"{endpoint}: {e}") from e
