"""The gRPC server process: grpc.aio on uvloop, the engine in a child process, and with
--http-port the OpenAI-compatible HTTP front in the same event loop.

Lifecycle: listen at once (health NOT_SERVING) -> spawn the engine -> SERVING once it is warm.
SIGTERM/SIGINT: NOT_SERVING, refuse new calls, let in-flight calls finish (drain_timeout_s),
stop the engine, exit 0. If the engine dies, or the watchdog finds it frozen or stuck (and kills
it), health goes NOT_SERVING and every call fails with UNAVAILABLE; the server stays up so that
probes see it (the orchestrator restarts it). A start-up error (a model folder or TLS file that
is not there, --http-port without the `http` extra: server/preflight.py, before anything binds;
a port that cannot be bound; the engine failing to start): one error line, exit 1.

With --front-processes N (data-parallel replicas only) this process supervises N front processes
(server/cluster/front_processes.py), each a SpecserveServer given a FrontLink: it binds the
ports with SO_REUSEPORT, gets its replicas' engines from the parent, and says SERVING only once
every front is ready.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from typing import Awaitable, Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from specserve.engine.config import EngineConfig
from specserve.engine.outputs import GrammarHealth
from specserve.engine.process import StartEngine
from specserve.server.cluster.config import ClusterConfig
from specserve.server.cluster.front_link import FrontChannel, FrontLink, FrontReady
from specserve.server.cluster.front_processes import FrontSupervisor
from specserve.server.cluster.metrics import ReplicaCollector
from specserve.server.cluster.replica_set import ReplicaSet
from specserve.server.config import ServerConfig
from specserve.server.engine_client import EngineClient, EngineUnavailable
from specserve.server.fronts.grpc.reflection import enable_reflection
from specserve.server.fronts.grpc.servicer import GenerationServicer
from specserve.server.generation import GenerationCore
from specserve.server.ops.health import GENERATION_SERVICE, HealthStatus
from specserve.server.ops.http_endpoint import HttpEndpoint
from specserve.server.ops.metrics import ServerMetrics
from specserve.server.ops.watchdog import EngineWatchdog
from specserve.server.preflight import StartupError, check_startup

logger = logging.getLogger("specserve.server")

LOAD_POLL_INTERVAL_S = 2.0  # the engine reports its load on request, between steps
STOP_GRACE_S = 1.0  # after draining: time for unary calls (health, load) in flight to end


class PortUnavailable(Exception):
    """A port the server was told to listen on cannot be bound (the message says why)."""


def _server_options(config: ServerConfig, reuse_port: bool = False) -> list[tuple[str, int]]:
    return [
        # gRPC sets SO_REUSEPORT by default, so a second server on the same port would start
        # and silently take a share of the connections; front processes share it on purpose.
        ("grpc.so_reuseport", int(reuse_port)),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Keep idle streaming connections alive through proxies and NATs.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def _check_port_free(host: str, port: int, reuse_port: bool = False) -> None:
    """Resolve the host and bind the port briefly to learn why it cannot be used: gRPC's bind
    error says only "Failed to bind" (the reason goes to its own log). reuse_port: as a front
    process binds it, beside the other fronts."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        if port == 0:  # any free port: nothing to probe
            return
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            probe.bind(address)
    except OSError as e:  # socket.gaierror included
        raise PortUnavailable(
            f"cannot listen on {host}:{port} (--port): {e.strerror or e}") from None


def _bind(server: grpc.aio.Server, config: ServerConfig, reuse_port: bool = False) -> int:
    _check_port_free(config.host, config.port, reuse_port)
    address = f"{config.host}:{config.port}"
    try:
        if config.tls_cert is None:
            return server.add_insecure_port(address)
        with open(config.tls_key, "rb") as key, open(config.tls_cert, "rb") as cert:
            credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
        return server.add_secure_port(address, credentials)
    except RuntimeError as e:  # taken between the check and the bind
        raise PortUnavailable(f"cannot listen on {address} (--port): {e}") from None


class SpecserveServer:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 start_engine: Optional[StartEngine] = None,
                 cluster: Optional[ClusterConfig] = None, front: Optional[FrontLink] = None):
        """cluster: data-parallel engine replicas on Ray (server/cluster) instead of one engine
        process; the set stands where the EngineClient does. front: this is one of several
        front processes (with a cluster), its replicas' engines started by the parent."""
        self.server_config = server_config
        self.stopping = asyncio.Event()
        self.front = None if front is None else FrontChannel(front, self.stopping.set)
        if cluster is None:
            self.engine = EngineClient(engine_config, EngineWatchdog(
                server_config.engine_heartbeat_timeout_s, server_config.engine_stall_timeout_s),
                start_engine, stream_interval=server_config.stream_interval)
        else:
            self.engine = ReplicaSet(engine_config, server_config, cluster, start_engine,
                                     None if self.front is None else self.front.launchers)
        self.health = HealthStatus()
        self.metrics = ServerMetrics(self.engine.watchdog.report)
        self.engine.on_steps = self.metrics.observe_engine_steps
        if cluster is not None:
            self.metrics.registry.register(ReplicaCollector(self.engine))
            self.engine.on_recovery(self._on_engine_recovery)
        self.http = HttpEndpoint(self.metrics.registry, lambda: self.health.serving)
        self.core = GenerationCore(self.engine, engine_config, server_config, self.metrics)
        if cluster is not None:  # admission covers every replica's running requests
            self.core.max_active_streams += ((cluster.data_parallel - 1)
                                             * engine_config.max_running_requests)
        self.servicer = GenerationServicer(self.core)
        self.http_api = None  # the OpenAI-compatible front (HttpApiServer), with --http-port
        self.grpc_server = grpc.aio.server(
            options=_server_options(server_config, reuse_port=self.front is not None))
        self.port: Optional[int] = None
        self._health_update: Optional[asyncio.Task] = None  # held so it is not collected early
        self._grammar_update: Optional[asyncio.Task] = None  # the same, for specserve.grammar

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit status 0), or exit status 1: a port cannot be bound
        or the engine fails to start."""
        config = self.server_config
        self.servicer.add_to_server(self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.grpc_server)
        if config.reflection:
            enable_reflection(self.grpc_server, (GENERATION_SERVICE, health.SERVICE_NAME))
        await self.health.set_serving(False)
        if self.front is not None:
            self.front.start()
        try:
            await self._listen()
        except PortUnavailable as e:
            logger.error("%s", e)
            await self.grpc_server.stop(None)
            if self.http_api is not None:
                await self.http_api.stop()
            await self.engine.shutdown()  # nothing started yet: releases its sockets
            self.core.close()
            if self.front is not None:
                await self.front.close()
            return 1
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        # Bound methods of self only once the ports are bound: a start that fails before must
        # leave nothing (FastAPI's caches keep the engine client alive) that holds the gRPC
        # server past its loop, whose destruction then printed a garbled sys.excepthook error.
        self.engine.on_death(self._on_engine_death)
        self.engine.on_grammar = self._on_grammar
        self.engine.start()
        if isinstance(self.engine, EngineClient):
            logger.info("engine process started (%s)", self.engine.handle.description)
            logger.info("detokenizer worker started (pid %d)", self.engine.text_worker_pid)
        exit_code = await self._until_stopped()
        await self._drain()
        return exit_code

    async def _listen(self) -> None:
        """Bind the gRPC port (and the HTTP port), then start serving; before anything is
        spawned, so that a port in use ends the server at once."""
        config = self.server_config
        self.port = _bind(self.grpc_server, config, reuse_port=self.front is not None)
        if config.metrics_port is not None:
            try:
                http_port = self.http.start(config.host, config.metrics_port)
            except OSError as e:
                raise PortUnavailable(f"cannot listen on {config.host}:{config.metrics_port} "
                                      f"(--metrics-port): {e.strerror or e}") from None
        if config.http_port is not None:
            self.http_api = self._build_http_api()
            try:
                http_api_port = self.http_api.bind()
            except OSError as e:
                raise PortUnavailable(f"cannot listen on {config.host}:{config.http_port} "
                                      f"(--http-port): {e.strerror or e}") from None
        await self.grpc_server.start()
        scheme = "grpcs" if config.tls_cert else "grpc"
        logger.info("serving on %s:%d (%s)", config.host, self.port, scheme)
        if self.http_api is not None:
            await self.http_api.start()
            logger.info("OpenAI-compatible API on %s://%s:%d/v1 (at most %d connections)",
                        "https" if config.tls_cert else "http", config.host, http_api_port,
                        self.http_api.limits.max_connections)
        if config.metrics_port is not None:
            logger.info("metrics and health on http://%s:%d/metrics and /health", config.host,
                        http_port)

    def _build_http_api(self):
        # Imported here: FastAPI and uvicorn are an optional dependency (the `http` extra) that
        # only --http-port needs.
        from specserve.server.fronts.openai.connections import ConnectionLimits
        from specserve.server.fronts.openai.routes import create_app
        from specserve.server.fronts.openai.server import HttpApiServer

        # Not a closure over self: FastAPI's caches keep the app's endpoints alive until the
        # interpreter exits, and with self the gRPC server, whose destruction then (after its
        # event loop) printed a garbled "Error in sys.excepthook".
        health = self.health
        config = self.server_config
        app = create_app(self.core, self.metrics.registry, lambda: health.serving,
                         config.max_message_bytes)
        return HttpApiServer(app, config.host, config.http_port, ConnectionLimits.of(config),
                             config.tls_cert, config.tls_key, reuse_port=self.front is not None)

    def _on_engine_death(self, reason: str) -> None:
        self._health_update = asyncio.get_running_loop().create_task(
            self.health.set_serving(False))

    def _on_grammar(self, health: GrammarHealth) -> None:
        """The engine's grammar service changed state: health service and metrics."""
        self.metrics.observe_grammar(health)
        if health.serving:
            logger.info("grammar service up (restarts: %d)", health.restarts)
        else:
            logger.warning("grammar service down: %s (restarts: %d)", health.detail, health.restarts)
        self._grammar_update = asyncio.get_running_loop().create_task(
            self.health.set_grammar_serving(health.serving))

    def _on_engine_recovery(self) -> None:
        """A replica serves again after none did (data-parallel replicas only)."""
        if not self.core.draining:
            self._health_update = asyncio.get_running_loop().create_task(
                self.health.set_serving(True))

    async def _until_stopped(self) -> int:
        ready = asyncio.ensure_future(self.engine.wait_ready())
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait([ready, stop], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return 0
        try:
            info = ready.result()
        except EngineUnavailable as e:
            logger.error("the engine failed to start: %s", e)
            stop.cancel()
            return 1
        self.core.on_engine_ready(info, self.engine.tokenizer)
        self.metrics.observe_speculation(info.spec)
        await self.core.warm_up()
        if self.front is not None and not await self._all_fronts_ready(stop):
            return 0
        await self.health.set_serving(True)
        logger.info("engine ready: %s (%s, %s, %s); SERVING", info.model, info.architecture,
                    info.device, info.dtype)
        watcher = asyncio.ensure_future(self._watch_load())
        await stop
        watcher.cancel()
        return 0

    async def _all_fronts_ready(self, stop: asyncio.Future) -> bool:
        """Tell the parent this front is ready and wait until every front is (False: stopped
        first)."""
        self.front.send(FrontReady(self.front.link.front))
        ready = asyncio.ensure_future(self.front.all_ready.wait())
        await asyncio.wait([ready, stop], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return False
        return True

    async def _watch_load(self) -> None:
        """Keep the load gauges fresh between scrapes, and while the engine has work log one
        line of throughput, queue and KV every `stats_log_interval_s`."""
        interval = self.server_config.stats_log_interval_s
        last_log, last_tokens = time.monotonic(), self._generated_tokens()
        while True:
            await asyncio.sleep(min(LOAD_POLL_INTERVAL_S, interval))
            try:
                load = await self.engine.load()
            except EngineUnavailable:
                continue
            self.metrics.observe_load(load)
            now, tokens = time.monotonic(), self._generated_tokens()
            if now - last_log < interval:
                continue
            if load.num_running or load.num_waiting or tokens > last_tokens:
                logger.info("throughput %.1f tokens/s; %d running, %d waiting; KV %d/%d (%.0f%%); "
                            "accept length %.2f", (tokens - last_tokens) / (now - last_log),
                            load.num_running, load.num_waiting, load.kv_used_tokens,
                            load.kv_total_tokens, 100 * load.kv_used_tokens / load.kv_total_tokens,
                            load.mean_accept_length)
            last_log, last_tokens = now, tokens

    def _generated_tokens(self) -> float:
        return self.metrics.registry.get_sample_value("specserve_generated_tokens_total") or 0.0

    async def _drain(self) -> None:
        # New calls get UNAVAILABLE (retry elsewhere) while running ones finish; the gRPC server
        # keeps listening meanwhile so that clients and probes get answers, not resets.
        self.core.draining = True
        await self.health.set_serving(False)
        timeout = self.server_config.drain_timeout_s
        logger.info("stopping: draining %d in-flight calls (up to %.0f s)",
                    self.core.num_active_streams, timeout)
        if not await self.core.wait_idle(timeout):
            logger.warning("%d calls still running after %.0f s; cancelling them",
                           self.core.num_active_streams, timeout)
        await self.grpc_server.stop(STOP_GRACE_S)
        if self.http_api is not None:
            await self.http_api.stop()
        await self.engine.shutdown()
        self.http.stop()
        self.core.close()
        if self.front is not None:
            await self.front.close()
        logger.info("stopped")


def run_server(engine_config: EngineConfig, server_config: ServerConfig,
               start_engine: Optional[StartEngine] = None,
               cluster: Optional[ClusterConfig] = None) -> int:
    """Run the server on uvloop when it is installed; returns the process exit status.
    start_engine: a stand-in for the engine (benchmarks of the server alone); cluster:
    data-parallel replicas on Ray (with front_processes > 1: this process supervises the
    fronts)."""
    try:
        check_startup(engine_config, server_config, local_engine=cluster is None)
    except StartupError as e:
        logger.error("%s", e)
        return 1

    async def main() -> int:
        if cluster is not None and cluster.front_processes > 1:
            return await FrontSupervisor(engine_config, server_config, cluster, start_engine,
                                         run_front).run()
        return await SpecserveServer(engine_config, server_config, start_engine, cluster).run()

    return _run_on_loop(main)


def run_front(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
              start_engine: Optional[StartEngine], front: FrontLink) -> None:
    """A front process's entry (spawned by FrontSupervisor); exits with the server's status."""
    logging.basicConfig(level=front.log_level, format=f"%(asctime)s front-{front.front} "
                                                      f"%(name)s %(levelname)s %(message)s")

    async def main() -> int:
        return await SpecserveServer(engine_config, server_config, start_engine, cluster,
                                     front).run()

    raise SystemExit(_run_on_loop(main))


def _run_on_loop(main: Callable[[], Awaitable[int]]) -> int:
    """main() on uvloop when it is installed (the server is made inside the loop: gRPC's aio
    server belongs to the loop it was made on)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
