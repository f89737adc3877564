"""A front process's side of --front-processes: its channel to the supervising parent.

With `ClusterConfig.front_processes` N > 1 the parent (front_processes.py) places the replicas
on Ray and starts each replica's engine once; N front processes each serve the public port(s)
(SO_REUSEPORT) with a ReplicaSet of their own. A front's EngineClients bind their sockets as
usual, but their launcher (FrontLauncher) does not start an engine: it sends the ServerLink to
the parent, which starts the engine once it has every front's link for that replica (the engine
connects to all of them: engine/process.py). The engine's exit is reported back by the parent
(Exited), and a watchdog's kill goes through it (Kill).

Launches are numbered per replica ("generations"): every front launches a replica's engine the
same number of times (at start, then once after each exit the parent reports), so (replica,
generation) names one engine in every process, and a late report of an old engine never touches
its successor.

The messages are pickled frozen dataclasses over one ZeroMQ DEALER (front) / ROUTER (parent)
pair on an ipc:// path; everything runs on the front's event loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Callable, Optional, Union

import zmq
import zmq.asyncio

from specserve.engine.config import EngineConfig
from specserve.engine.process import ServerLink, ServerLinks, StartEngine
from specserve.server.engine_client import EngineHandle, EngineLauncher

logger = logging.getLogger("specserve.server.cluster")

PARENT_CHECK_INTERVAL_S = 1.0  # how often a front checks that its parent is still there


# --- front -> parent ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    front: int


@dataclass(frozen=True)
class Attach:
    """This front's sockets for the replica's engine of this generation."""

    front: int
    replica: int
    generation: int
    link: ServerLink


@dataclass(frozen=True)
class Kill:
    """The front's watchdog found the engine frozen or stuck."""

    replica: int
    generation: int


@dataclass(frozen=True)
class FrontReady:
    """The front's replicas are ready and its tokenizer workers warm."""

    front: int


# --- parent -> front ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Placed:
    """The replicas are placed; the fronts bind on this address (None: ipc:// paths)."""

    replicas: int
    bind_host: Optional[str]


@dataclass(frozen=True)
class Exited:
    replica: int
    generation: int
    reason: str


@dataclass(frozen=True)
class AllReady:
    """Every front is ready: health may say SERVING."""


FrontMessage = Union[Hello, Attach, Kill, FrontReady]
ParentMessage = Union[Placed, Exited, AllReady]


@dataclass(frozen=True)
class FrontLink:
    """What a front process is told at its start (picklable)."""

    front: int
    fronts: int
    parent_address: str  # the parent's ROUTER
    parent_pid: int
    log_level: int = logging.INFO  # the parent's (--log-level)


def front_identity(front: int) -> bytes:
    """The front's DEALER identity: the parent's ROUTER addresses it by this."""
    return f"front-{front}".encode()


class FrontChannel:
    """The front's end: sends what the front's replica set does, dispatches what the parent
    says. Not thread-safe: the front's event loop only."""

    def __init__(self, link: FrontLink, on_parent_gone: Callable[[], None]):
        self.link = link
        self._zmq = zmq.asyncio.Context()
        self._socket = self._zmq.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IDENTITY, front_identity(link.front))
        self._socket.connect(link.parent_address)
        self._on_parent_gone = on_parent_gone
        self._placed: Optional[asyncio.Future[Placed]] = None
        self.all_ready = asyncio.Event()
        self._engines: dict[tuple[int, int], RemoteEngine] = {}
        self._generations: dict[int, int] = {}  # replica -> launches so far
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._placed = loop.create_future()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch_parent())]
        self.send(Hello(self.link.front))

    def send(self, message: FrontMessage) -> None:
        # Non-blocking: the parent reads at once, and a DEALER queues while it is not there.
        self._socket.send(pickle.dumps(message), flags=zmq.NOBLOCK)

    async def launchers(self) -> list["FrontLauncher"]:
        """One launcher per replica, once the parent has placed them."""
        placed = await asyncio.shield(self._placed)
        return [FrontLauncher(self, index, placed.bind_host) for index in range(placed.replicas)]

    def launch(self, replica: int, link: ServerLink) -> "RemoteEngine":
        generation = self._generations.get(replica, 0)
        self._generations[replica] = generation + 1
        engine = RemoteEngine(self, replica, generation)
        self._engines[replica, generation] = engine
        self.send(Attach(self.link.front, replica, generation, link))
        return engine

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.close()
        self._zmq.term()

    async def _read(self) -> None:
        while True:
            message: ParentMessage = pickle.loads(await self._socket.recv())
            if isinstance(message, Placed):
                if not self._placed.done():
                    self._placed.set_result(message)
            elif isinstance(message, Exited):
                engine = self._engines.pop((message.replica, message.generation), None)
                if engine is not None:
                    engine.exited(message.reason)
            elif isinstance(message, AllReady):
                self.all_ready.set()

    async def _watch_parent(self) -> None:
        """A front outlives its parent only by this long (the parent's Ray driver, and with it
        the replicas, are gone then)."""
        while os.getppid() == self.link.parent_pid:
            await asyncio.sleep(PARENT_CHECK_INTERVAL_S)
        logger.error("front %d: the parent process %d is gone; stopping", self.link.front,
                     self.link.parent_pid)
        self._on_parent_gone()


class RemoteEngine(EngineHandle):
    """A replica's engine that the parent started, seen from a front."""

    def __init__(self, channel: FrontChannel, replica: int, generation: int):
        self.channel = channel
        self.replica = replica
        self.generation = generation
        self.description = f"replica {replica}, engine {generation}, started by the parent"
        self._on_exit: Optional[Callable[[str], None]] = None
        self._exited = asyncio.Event()

    def watch_exit(self, on_exit: Callable[[str], None]) -> None:
        self._on_exit = on_exit

    def exited(self, reason: str) -> None:
        self._exited.set()
        if self._on_exit is not None:
            self._on_exit(reason)

    async def stop(self) -> None:
        """Nothing to wait for: the engine closes this front's link on its Shutdown and lives
        on for the other fronts (the parent stops it once all are done)."""

    async def kill(self) -> None:
        self.channel.send(Kill(self.replica, self.generation))
        await self._exited.wait()


class FrontLauncher(EngineLauncher):
    """Replica `index`'s engines, started by the parent once every front attached."""

    def __init__(self, channel: FrontChannel, index: int, bind_host: Optional[str]):
        self.channel = channel
        self.index = index
        self.bind_host = bind_host

    def launch(self, config: EngineConfig, link: ServerLinks,
               start_engine: Optional[StartEngine]) -> EngineHandle:
        # The parent starts the engine with its own config and start_engine (the same ones).
        assert isinstance(link, ServerLink), link
        return self.channel.launch(self.index, link)
