"""--front-processes N: N front processes serve one port, under one supervising parent.

One Python process (its event loop, gRPC's C core under the GIL) could not feed 4 replicas: at
256 streams its front sat at 110-120 % of a core (bench/data_parallel.py's front profile). So
the parent here does no request work: it

- reserves the public ports (--port, --http-port; 0: one free port for all) and spawns N
  front processes, each an ordinary server (app.py) whose gRPC and HTTP sockets bind the same
  ports with SO_REUSEPORT, so the kernel spreads connections over them (per connection: a
  client's calls on one channel stay on one front); front i serves --metrics-port + i;
- places the replicas on Ray once, and starts each replica's engine once every front has
  attached its sockets for it (front_link.py); the engine serves every front at once
  (engine/process.py), and its exit is reported to every front, which restart it as with one
  front (the parent starts the new engine when all have attached again); a front's watchdog
  kills an engine through the parent;
- says AllReady once every front is ready, so that health is SERVING on no front before all
  are up;
- stops everything on SIGTERM/SIGINT (the fronts drain, then the engines stop once every
  front closed its link, and Ray goes), with the fronts' exit status;
- and if a front process dies, stops the others and the replicas and exits 1, loudly: the
  front held calls and an engine link that cannot be handed to a new process, so the
  orchestrator restarts the server as for any dead server (docs/deployment.md).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
from typing import Callable, Optional

import zmq
import zmq.asyncio

from specserve.engine.config import EngineConfig
from specserve.engine.process import ServerLink, StartEngine
from specserve.server.cluster.config import ClusterConfig, replica_engine_config
from specserve.server.cluster.front_link import (AllReady, Attach, Exited, FrontLink, FrontReady,
                                                 Hello, Kill, Placed, front_identity)
from specserve.server.config import ServerConfig
from specserve.server.engine_client import EngineHandle, EngineLauncher

logger = logging.getLogger("specserve.server.cluster")

FRONT_EXIT_GRACE_S = 30.0  # past its drain timeout, a front that has not exited is killed
FRONT_REAP_S = 5.0  # the most a dead front's exit code takes to read

# A front process's entry (app.py's run_front): picklable, run in a spawned process.
FrontMain = Callable[[EngineConfig, ServerConfig, ClusterConfig, Optional[StartEngine],
                      FrontLink], None]


def front_server_config(config: ServerConfig, front: int) -> ServerConfig:
    """Front `front`'s ServerConfig: --metrics-port moves up by its index (0 stays 0: a free
    port each); ValueError naming the field when that passes 65535."""
    if config.metrics_port in (None, 0) or front == 0:
        return config
    try:
        return dataclasses.replace(config, metrics_port=config.metrics_port + front)
    except ValueError as e:
        raise ValueError(f"{e} (front process {front} serves its metrics at the port + "
                         f"{front})") from None


def reserve_port(host: str, port: int, flag: str) -> socket.socket:
    """Bind (host, port) with SO_REUSEPORT without listening: the fronts bind beside it, and
    with port 0 it picks their one port. OSError with a message naming the flag."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({flag}): {e.strerror or e}") from None
    return sock


class FrontSupervisor:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 cluster: ClusterConfig, start_engine: Optional[StartEngine],
                 front_main: FrontMain):
        self.engine_config = engine_config
        self.server_config = server_config
        self.cluster = cluster
        self.start_engine = start_engine
        self.front_main = front_main
        self.count = cluster.front_processes
        self.fronts: list[multiprocessing.process.BaseProcess] = []
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self._front_died = False
        self._launchers: list[EngineLauncher] = []
        self._placed: Optional[Placed] = None
        self._hello: set[int] = set()
        self._ready: set[int] = set()
        self._attached: dict[tuple[int, int], dict[int, ServerLink]] = {}  # by front
        self._engines: dict[int, tuple[int, EngineHandle]] = {}  # replica -> (generation, engine)
        self._tasks: set[asyncio.Task] = set()
        self._zmq = zmq.asyncio.Context()
        self._socket = self._zmq.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._ipc_dir = tempfile.mkdtemp(prefix="specserve-fronts-")

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT (0 when every front stopped cleanly) or a front's
        death (1)."""
        config = self.server_config
        reserved = []
        try:
            reserved.append(reserve_port(config.host, config.port, "--port"))
            config = dataclasses.replace(config, port=reserved[-1].getsockname()[1])
            if config.http_port is not None:
                reserved.append(reserve_port(config.host, config.http_port, "--http-port"))
                config = dataclasses.replace(config, http_port=reserved[-1].getsockname()[1])
        except OSError as e:
            logger.error("%s", e)
            for sock in reserved:
                sock.close()
            self._close()
            return 1
        address = f"ipc://{os.path.join(self._ipc_dir, 'parent')}"
        self._socket.bind(address)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self._spawn(self._read())
        self._spawn(self._place())
        root_level = logging.getLogger().getEffectiveLevel()
        for front in range(self.count):
            link = FrontLink(front, self.count, address, os.getpid(), root_level)
            process = multiprocessing.get_context("spawn").Process(
                target=self.front_main, name=f"specserve-front-{front}",
                args=(self.engine_config, front_server_config(config, front), self.cluster,
                      self.start_engine, link))
            process.start()
            self.fronts.append(process)
            loop.add_reader(process.sentinel, self._front_exited, front)
        logger.info("%d front processes (pids %s) serve %s:%d", self.count,
                    ", ".join(str(p.pid) for p in self.fronts), config.host, config.port)
        await self.stopping.wait()
        await self._stop_fronts()
        await self._stop_engines()
        for sock in reserved:
            sock.close()
        self._close()
        logger.info("stopped")
        return self.exit_code

    # --- the fronts ---------------------------------------------------------------------------
    def _send(self, front: int, message) -> None:
        if front in self._hello:  # a ROUTER drops what it cannot route: only to fronts heard
            self._socket.send_multipart([front_identity(front), pickle.dumps(message)],
                                        flags=zmq.NOBLOCK)

    def _broadcast(self, message) -> None:
        for front in range(self.count):
            self._send(front, message)

    async def _read(self) -> None:
        while True:
            _, data = await self._socket.recv_multipart()
            message = pickle.loads(data)
            if isinstance(message, Hello):
                self._hello.add(message.front)
                if self._placed is not None:
                    self._send(message.front, self._placed)
            elif isinstance(message, Attach):
                self._attach(message)
            elif isinstance(message, Kill):
                current = self._engines.get(message.replica)
                if current is not None and current[0] == message.generation:
                    logger.error("replica %d: a front's watchdog asks to kill its engine",
                                 message.replica)
                    self._spawn(current[1].kill())
            elif isinstance(message, FrontReady):
                self._ready.add(message.front)
                if len(self._ready) == self.count:
                    logger.info("all %d front processes ready; SERVING", self.count)
                    self._broadcast(AllReady())

    def _front_exited(self, front: int) -> None:
        process = self.fronts[front]
        asyncio.get_running_loop().remove_reader(process.sentinel)
        # The sentinel closes as the process dies, a moment before it can be reaped: join(0)
        # could read its exit code as None. It is dead, so this returns at once (the parent's
        # loop serves no calls).
        process.join(FRONT_REAP_S)
        if self.stopping.is_set():
            return
        logger.error("front process %d (pid %d) exited with code %s; stopping the server",
                     front, process.pid, process.exitcode)
        self._front_died = True
        self.exit_code = 1
        self.stopping.set()

    async def _stop_fronts(self) -> None:
        """SIGTERM: each drains its calls and closes its engine links; killed past its drain
        timeout and a grace."""
        for process in self.fronts:
            if process.is_alive():
                process.terminate()
        timeout = self.server_config.drain_timeout_s + FRONT_EXIT_GRACE_S
        for front, process in enumerate(self.fronts):
            await asyncio.to_thread(process.join, timeout)
            if process.is_alive():
                logger.error("front process %d did not stop; killing it", front)
                process.kill()
                await asyncio.to_thread(process.join)
            if process.exitcode != 0:
                self.exit_code = 1

    # --- the replicas -------------------------------------------------------------------------
    async def _place(self) -> None:
        from specserve.server.cluster.ray_replicas import place_replicas  # Ray: only here

        try:
            self._launchers = await asyncio.to_thread(place_replicas, self.cluster,
                                                      self.engine_config)
        except Exception:
            logger.exception("placing the replicas on Ray failed")
            self.exit_code = 1
            self.stopping.set()
            return
        self._placed = Placed(len(self._launchers), self._launchers[0].bind_host)
        self._broadcast(self._placed)

    def _attach(self, message: Attach) -> None:
        key = (message.replica, message.generation)
        links = self._attached.setdefault(key, {})
        links[message.front] = message.link
        if len(links) < self.count or self.stopping.is_set():
            return
        del self._attached[key]
        replica, generation = key
        engine = self._launchers[replica].launch(
            replica_engine_config(self.engine_config, replica, self.cluster.gpus_per_rank),
            tuple(links[front] for front in range(self.count)), self.start_engine)
        self._engines[replica] = (generation, engine)
        engine.watch_exit(lambda reason: self._broadcast(Exited(replica, generation, reason)))

    async def _stop_engines(self) -> None:
        """After the fronts: an engine whose every front closed its link has exited or is
        exiting; one a dead front never closed is killed."""
        engines = [engine for _, engine in self._engines.values()]
        await asyncio.gather(*(engine.kill() if self._front_died else engine.stop()
                               for engine in engines))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._launchers:
            from specserve.server.cluster.ray_replicas import disconnect

            await asyncio.to_thread(disconnect)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _close(self) -> None:
        self._socket.close()
        self._zmq.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

