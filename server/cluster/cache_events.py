"""Each replica's KV-cache events, read for the router (routing.py).

The set binds one SUB socket per replica (ipc:// beside the engine client's, or tcp:// on this
node's IP when replicas run on Ray) and hands its address to the replica's engine, whose
publisher connects to it (engine/kv_events.py, besides any --kv-events-endpoint of the user's).
A task on the server's loop decodes each batch and gives the router its events: the router then
knows what each engine's prefix cache holds, evictions included, rather than only what it sent.

A sequence number that skips means batches were lost (the PUB socket dropped them past its
high-water mark): the router's view of that replica is then incomplete, so it is dropped and
rebuilt from the following events. A restarted engine numbers from 0 again; its cache is
empty and the set has already told the router so.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, Optional

import zmq
import zmq.asyncio

from specserve.engine.kv_events import decode_batch
from specserve.engine.kvcache.block_events import KVEvent

logger = logging.getLogger("specserve.server.cluster")


class ReplicaCacheEvents:
    """One replica's event socket and its reader task; `on_events(events)` runs on the loop,
    `on_gap()` when batches were lost."""

    def __init__(self, context: zmq.asyncio.Context, bind_host: Optional[str], ipc_dir: str,
                 name: str, on_events: Callable[[list[KVEvent]], None],
                 on_gap: Callable[[], None]):
        self._socket = context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        if bind_host is None:
            self.address = f"ipc://{os.path.join(ipc_dir, name)}"
            self._socket.bind(self.address)
        else:
            self.address = f"tcp://{bind_host}:{self._socket.bind_to_random_port(f'tcp://{bind_host}')}"
        self._on_events = on_events
        self._on_gap = on_gap
        self._next: Optional[int] = None  # the sequence number expected next
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close()

    async def _read(self) -> None:
        while True:
            _, sequence, payload = await self._socket.recv_multipart()
            sequence = int.from_bytes(sequence, "big")
            if self._next is not None and sequence not in (self._next, 0):
                logger.warning("KV-cache events: batches %d..%d lost; the router forgets what "
                               "this replica caches", self._next, sequence - 1)
                self._on_gap()
            self._next = sequence + 1
            try:
                _, events = decode_batch(payload)
            except (ValueError, TypeError, IndexError) as e:  # not ours: nothing to apply
                logger.warning("KV-cache events: an undecodable batch (%s)", e)
                continue
            self._on_events(events)
