"""ReplicaSet: N data-parallel engines behind the surface of one EngineClient.

The fronts and the generation core call it where they call a single EngineClient (submit,
abort, load, check_available, wait_ready, on_death). Each replica is an ordinary EngineClient
whose engine runs in a Ray actor (ray_replicas.py), so every guarantee of one engine (outputs
routed per request, KV freed on abort, the watchdog) holds per replica. The set adds:

- Routing (routing.py): a request goes to one replica, all its n sequences with it, chosen by
  prefix affinity bounded by load; aborts follow the request to its replica. The router reads
  each replica's KV-cache events (cache_events.py) to know what its prefix cache holds.
- Failure isolation: a replica whose engine dies (or that its watchdog kills) fails only its
  own calls (UNAVAILABLE) and leaves routing at once; the set is available while any replica
  serves, and reports death (health NOT_SERVING) only when none does, and recovery when one
  serves again.
- Restarts: a replica that had served is started again with a fresh EngineClient (new sockets,
  a new engine in its actor, which Ray itself restarts if the actor died) after a backoff; its
  router memory is dropped, since its prefix cache is empty.

The set places the replicas on Ray itself, or (a front process of --front-processes) is given
launchers by `place`: the parent placed the replicas and starts their engines (front_link.py).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import zmq.asyncio

from specserve.engine.config import EngineConfig, SamplingParams
from specserve.engine.outputs import EngineInfo, EngineLoad
from specserve.engine.process import StartEngine
from specserve.proto import generate_pb2 as pb
from specserve.server.cluster.cache_events import ReplicaCacheEvents
from specserve.server.cluster.config import ClusterConfig, replica_engine_config
from specserve.server.cluster.routing import PrefixRouter, ReplicaState, RoutingPolicy
from specserve.server.config import ServerConfig
from specserve.server.engine_client import EngineClient, EngineLauncher, EngineUnavailable
from specserve.server.ops.watchdog import EngineWatchdog, WatchdogReport, WatchdogState
from specserve.server.output_router import RequestStream
from specserve.server.text.validation import ValidatedRequest

logger = logging.getLogger("specserve.server.cluster")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's row in GetServerLoad and in the per-replica metrics."""

    replica: int
    serving: bool
    load: Optional[EngineLoad]  # None: not serving, or it did not answer
    active_streams: int
    restarts: int

    def to_proto(self) -> pb.ReplicaLoad:
        row = pb.ReplicaLoad(replica=self.replica, serving=self.serving,
                             num_active_streams=self.active_streams, restarts=self.restarts)
        if self.load is not None:
            for name in ("num_running", "num_waiting", "kv_used_tokens", "kv_total_tokens",
                         "kv_cached_tokens", "prefix_cache_hit_rate"):
                setattr(row, name, getattr(self.load, name))
        return row


class _Replica:
    """One slot of the set: its launcher (actor) lives on, its EngineClient is per engine."""

    def __init__(self, index: int, launcher: EngineLauncher):
        self.index = index
        self.launcher = launcher
        self.client: Optional[EngineClient] = None
        self.cache_events: Optional[ReplicaCacheEvents] = None  # its engine's KV-cache events
        self.serving = False
        self.served_once = False
        self.active_streams = 0
        self.restarts = 0
        # Engine steps reported and the seconds they took (StepStat): how busy the engine is
        # kept, against the wall clock (bench/data_parallel.py's per-replica profile).
        self.steps = 0
        self.step_seconds = 0.0
        self.failures_in_a_row = 0


# Places the replicas: one launcher per replica, in replica order.
Place = Callable[[], Awaitable[list[EngineLauncher]]]


class ReplicaSet:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 cluster: ClusterConfig, start_engine: Optional[StartEngine] = None,
                 place: Optional[Place] = None):
        """place: None places the replicas on Ray from this process (and leaves Ray at
        shutdown); a front process's set gets its launchers from its parent instead."""
        self.config = engine_config
        self._place = place
        self.server_config = server_config
        self.cluster = cluster
        self.start_engine = start_engine
        self.watchdog = _SetWatchdog(self)
        self.info: Optional[EngineInfo] = None
        self.tokenizer: Any = None
        self.replicas: list[_Replica] = []
        # Blocks named as the engines' events name them.
        self.router = PrefixRouter(cluster.data_parallel, dataclasses.replace(
            cluster.routing, block_size=engine_config.kv_events_block_size))
        # Prefix routing reads the replicas' KV-cache events (there are none without a cache).
        self._reads_cache_events = (cluster.routing.policy is RoutingPolicy.PREFIX
                                    and engine_config.enable_prefix_cache)
        self._zmq: Optional[zmq.asyncio.Context] = None  # of the event sockets
        self._ipc_dir: Optional[str] = None
        self._routes: dict[str, _Replica] = {}  # rid -> the replica serving it
        self.last_rows: list[ReplicaLoad] = []  # of the latest load query
        self.routed: collections.Counter[tuple[int, str]] = collections.Counter()  # (replica, reason)
        self._ready: Optional[asyncio.Future[EngineInfo]] = None
        self._closing = False
        self._death_callbacks: list[Callable[[str], None]] = []
        self._recovery_callbacks: list[Callable[[], None]] = []
        self._tasks: set[asyncio.Task] = set()
        # Every replica's steps (EngineClient.on_steps), with the set's load: the sum of each
        # serving replica's load after its latest step.
        self.on_steps: Optional[Callable[[list, Optional[EngineLoad]], None]] = None
        self._step_loads: dict[int, EngineLoad] = {}
        self.on_grammar: Optional[Callable] = None  # every replica's grammar health (EngineClient)

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Place the replicas and start their engines (returns at once; see wait_ready)."""
        self._ready = asyncio.get_running_loop().create_future()
        self._spawn(self._start())

    async def _start(self) -> None:
        try:
            launchers = await (self._place or self._place_on_ray)()
        except Exception as e:  # Ray could not start or be reached
            logger.exception("placing the replicas on Ray failed")
            self._ready.set_exception(EngineUnavailable(f"placing the replicas on Ray failed: {e}"))
            return
        self.replicas = [_Replica(i, launcher) for i, launcher in enumerate(launchers)]
        for replica in self.replicas:
            if self._reads_cache_events:
                self._read_cache_events(replica)
            self._start_engine(replica)
        try:
            # Every replica serves the same model; all must start, as one engine must.
            infos = await asyncio.gather(*(r.client.wait_ready() for r in self.replicas))
        except EngineUnavailable as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            return
        self.info, self.tokenizer = infos[0], self.replicas[0].client.tokenizer
        if not self._ready.done():
            self._ready.set_result(self.info)

    async def _place_on_ray(self) -> list[EngineLauncher]:
        from specserve.server.cluster.ray_replicas import place_replicas  # Ray: only here

        return await asyncio.to_thread(place_replicas, self.cluster, self.config)

    async def wait_ready(self) -> EngineInfo:
        """The engines' info once every replica is loaded and warm; EngineUnavailable if one
        failed to start."""
        return await asyncio.shield(self._ready)

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call callback(reason) when no replica serves any more."""
        self._death_callbacks.append(callback)

    def on_recovery(self, callback: Callable[[], None]) -> None:
        """Call callback() when a replica serves again after none did."""
        self._recovery_callbacks.append(callback)

    async def shutdown(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(r.client.shutdown() for r in self.replicas if r.client is not None))
        await asyncio.gather(*(r.cache_events.close() for r in self.replicas
                               if r.cache_events is not None))
        if self._zmq is not None:
            self._zmq.term()
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineUnavailable("the server is shutting down"))
        if self.replicas and self._place is None:
            from specserve.server.cluster.ray_replicas import disconnect

            await asyncio.to_thread(disconnect)

    # --- requests ------------------------------------------------------------------------
    def submit(self, rid: str, request: ValidatedRequest, report_spec: bool) -> RequestStream:
        """As EngineClient.submit, on the replica the router picks (all n sequences there)."""
        self.check_available()
        live = self._serving()
        kv_use = {row.replica: row.load.kv_used_tokens / row.load.kv_total_tokens
                  for row in self.last_rows if row.load is not None}
        route = self.router.route(request.prompt_token_ids, [
            ReplicaState(r.index, r.active_streams, kv_use.get(r.index, 0.0)) for r in live])
        replica = self.replicas[route.replica]
        stream = replica.client.submit(rid, request, report_spec)
        replica.active_streams += 1
        self._routes[rid] = replica
        self.routed[replica.index, route.reason] += 1
        logger.debug("request %s -> replica %d (%s, %d tokens expected cached)", rid,
                     replica.index, route.reason, route.matched_tokens)
        return stream

    def abort(self, rid: str, index: Optional[int] = None) -> None:
        """As EngineClient.abort. The core aborts every request when its call ends (a no-op for
        a finished one), which is when the set forgets its route."""
        replica = self._routes.get(rid) if index is not None else self._routes.pop(rid, None)
        if replica is None:
            return
        if index is None:
            replica.active_streams -= 1
        if replica.client is not None:
            replica.client.abort(rid, index)

    async def load(self, flush_prefix_cache: bool = False) -> EngineLoad:
        """The totals over the serving replicas (each flushed first if asked)."""
        rows = self.last_rows = await self._query_rows(flush_prefix_cache)
        loads = [row.load for row in rows if row.load is not None]
        if not loads:
            self.check_available()
            raise EngineUnavailable("no replica reported its load")
        return _total(loads)

    async def _query_rows(self, flush_prefix_cache: bool = False) -> list[ReplicaLoad]:
        """One row per replica, serving or not (queried concurrently)."""
        async def row(replica: _Replica) -> ReplicaLoad:
            load = None
            if replica.serving:
                try:
                    load = await replica.client.load(flush_prefix_cache)
                except EngineUnavailable:
                    pass
            if flush_prefix_cache and load is not None:
                self.router.forget(replica.index)
            return ReplicaLoad(replica.index, replica.serving, load, replica.active_streams,
                               replica.restarts)

        return list(await asyncio.gather(*(row(r) for r in self.replicas)))

    def check_available(self) -> None:
        """Raise EngineUnavailable (saying why) unless some replica takes requests now."""
        if self._closing:
            raise EngineUnavailable("the server is shutting down")
        if self.info is None:  # the server serves once every replica is ready, as with one
            raise EngineUnavailable("the engine replicas are still starting (placing, loading "
                                    "and warming up)")
        if self._serving():
            return
        raise EngineUnavailable(f"no engine replica serves now (all {len(self.replicas)} are "
                                f"restarting)")

    # --- internals -----------------------------------------------------------------------
    def _serving(self) -> list[_Replica]:
        return [r for r in self.replicas if r.serving]

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _read_cache_events(self, replica: _Replica) -> None:
        """Bind the replica's event socket (kept across its engine's restarts) and apply what
        arrives to the router."""
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
            self._ipc_dir = tempfile.mkdtemp(prefix="specserve-kv-events-")
        index = replica.index
        replica.cache_events = ReplicaCacheEvents(
            self._zmq, replica.launcher.bind_host, self._ipc_dir, f"replica-{index}",
            on_events=lambda events: self.router.apply_events(index, events),
            on_gap=lambda: self.router.forget(index))
        replica.cache_events.start()

    def engine_config(self, index: int) -> EngineConfig:
        """Replica `index`'s engine config: its share of a GPU on a fraction of one, its own
        KV-event ports (replica_engine_config)."""
        return replica_engine_config(self.config, index, self.cluster.gpus_per_rank)

    def _start_engine(self, replica: _Replica) -> None:
        config = self.server_config
        events = replica.cache_events
        client = EngineClient(self.engine_config(replica.index), EngineWatchdog(
            config.engine_heartbeat_timeout_s, config.engine_stall_timeout_s),
            self.start_engine, replica.launcher,
            kv_events=None if events is None else events.address,
            stream_interval=config.stream_interval)
        client.on_death(lambda reason: self._on_death(replica, client, reason))
        client.on_steps = lambda steps, load: self._on_replica_steps(replica.index, steps, load)
        client.on_grammar = lambda health: self.on_grammar is not None and self.on_grammar(health)
        replica.client = client
        client.start()
        self._spawn(self._until_serving(replica, client))

    async def _until_serving(self, replica: _Replica, client: EngineClient) -> None:
        try:
            await client.wait_ready()
        except EngineUnavailable:
            return  # _on_death has it
        was_down = not self._serving()
        replica.serving = replica.served_once = True
        replica.failures_in_a_row = 0
        logger.info("replica %d serving (%s)", replica.index, client.handle.description)
        if was_down and self.info is not None:
            for callback in self._recovery_callbacks:
                callback()

    def _on_replica_steps(self, index: int, steps: list, load: Optional[EngineLoad]) -> None:
        replica = self.replicas[index]
        replica.steps += len(steps)
        replica.step_seconds += sum(step.seconds for step in steps)
        if load is not None:
            self._step_loads[index] = load
        if self.on_steps is not None:
            self.on_steps(steps, None if load is None else _total(list(self._step_loads.values())))

    def _on_death(self, replica: _Replica, client: EngineClient, reason: str) -> None:
        if self._closing or replica.client is not client:
            return
        replica.serving = False
        self._step_loads.pop(replica.index, None)
        self.router.forget(replica.index)
        logger.error("replica %d left routing: %s", replica.index, reason)
        if not self._serving():
            for callback in self._death_callbacks:
                callback(reason)
        # One that never served failed to start: a configuration error, which a restart
        # repeats (the server's start fails instead, as with one engine).
        if replica.served_once:
            self._spawn(self._restart(replica, client))

    async def _restart(self, replica: _Replica, dead: EngineClient) -> None:
        await dead.shutdown()  # its engine is gone or killed; frees the sockets
        backoff = min(self.cluster.restart_backoff_s * 2 ** replica.failures_in_a_row,
                      self.cluster.max_restart_backoff_s)
        replica.failures_in_a_row += 1
        await asyncio.sleep(backoff)
        replica.restarts += 1
        logger.info("replica %d: starting its engine again (restart %d)", replica.index,
                    replica.restarts)
        self._start_engine(replica)


def _total(loads: list[EngineLoad]) -> EngineLoad:
    """Counts add up; the rates are the means over the replicas."""
    summed = {name: sum(getattr(load, name) for load in loads) for name in EngineLoad._fields}
    for name in ("mean_accept_length", "prefix_cache_hit_rate"):
        summed[name] /= len(loads)
    return EngineLoad(**summed)


class _SetWatchdog:
    """The set's verdict for the server's watchdog metrics: OK while any replica's engine is
    (each replica's own state is in the per-replica metrics)."""

    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas

    def report(self) -> WatchdogReport:
        reports = [r.client.watchdog.report() for r in self.replicas.replicas
                   if r.client is not None]
        ok = [report for report in reports if report.state is WatchdogState.OK]
        if ok:
            return min(ok, key=lambda report: report.heartbeat_age_s)
        return reports[0] if reports else WatchdogReport(WatchdogState.STARTING, 0.0, 0.0)
