"""Engine replicas and tensor-parallel ranks as Ray actors (the one module that imports Ray).

Each replica gets a placement group and a `ReplicaHost` actor in its first bundle. The host
runs the ordinary engine process (`run_engine_process`) as its child, connected over tcp:// to
the ports the server's EngineClient bound, so requests, outputs, heartbeats and the watchdog
work across nodes exactly as they do on one host. The host lives as long as the server: Ray
restarts it if it dies (max_restarts), and the server's ReplicaSet starts a new engine in it
whenever its engine died. With `TPPlacement.PACK`/`SPREAD` the host also starts one `TPRank`
actor per follower rank, each in a bundle of its own (other nodes included), which join rank 0
over torch.distributed (gloo on CPUs, NCCL on GPUs) at a tcp:// address on the host's node.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

# Read when Ray is imported: Ray's handler for fatal signals would otherwise log SIGTERM, the
# server's ordinary stop (it drains), as a crash with a stack trace.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

import ray  # noqa: E402
from ray.util.placement_group import placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from specserve.engine.config import EngineConfig
from specserve.engine.process import ServerLinks, StartEngine, run_engine_process, start_warm_engine
from specserve.server.cluster.config import ClusterConfig, TPPlacement
from specserve.server.engine_client import SHUTDOWN_TIMEOUT_S, EngineHandle, EngineLauncher

logger = logging.getLogger("specserve.server.cluster")

RAY_NAMESPACE = "specserve"


@dataclass(frozen=True)
class EngineStarted:
    """What a host reports once its engine process runs."""

    pid: int
    host_pid: int
    node_ip: str
    rank_nodes: tuple[str, ...]  # with rank actors: the Ray node id of each rank, 0 first


class ReplicaHost:
    """A replica's actor: starts, watches and kills its engine process (and its rank actors).

    Threaded (max_concurrency): wait_engine blocks a thread for the engine's whole life while
    kill_engine must still get through."""

    def __init__(self, index: int):
        self.index = index
        self._lock = threading.Lock()
        self._process: Optional[multiprocessing.process.BaseProcess] = None
        self._ranks: list = []  # TPRank actors of the current engine
        self._rendezvous = None  # where they meet (a tp_group.Rendezvous), held while they run

    def start_engine(self, config: EngineConfig, link: ServerLinks,
                     start_engine: Optional[StartEngine], rank_actors: bool) -> EngineStarted:
        self.kill_engine()  # a leftover of an engine the server gave up on
        node_ip = ray.util.get_node_ip_address()
        rank_nodes: tuple[str, ...] = ()
        if rank_actors and config.tp_size > 1:
            from specserve.engine.runtime.tp_group import Rendezvous  # torch only on a host of ranks

            rendezvous = Rendezvous(node_ip)
            init_method = rendezvous.init_method
            group = ray.util.get_current_placement_group()
            gpus = ray.get_runtime_context().get_assigned_resources().get("GPU", 0)
            ranks = [TPRankActor.options(
                num_cpus=1, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank),
            ).remote() for rank in range(1, config.tp_size)]
            with self._lock:  # killed with the engine from now on, even if it fails to spawn
                self._ranks, self._rendezvous = ranks, rendezvous
            for rank, actor in enumerate(ranks, start=1):
                actor.run.remote(config, rank, init_method)
            rank_nodes = (ray.get_runtime_context().get_node_id(),
                          *ray.get([actor.node_id.remote() for actor in ranks]))
            start_engine = functools.partial(start_engine or start_warm_engine,
                                             tp_init_method=init_method)
        # spawn: this actor runs Ray's threads; the engine's ppid check ties it to this actor.
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(config, link, start_engine),
            name=f"specserve-engine-{self.index}")
        process.start()
        with self._lock:
            self._process = process
        return EngineStarted(process.pid, os.getpid(), node_ip, rank_nodes)

    def wait_engine(self) -> Optional[int]:
        """Block until the current engine process exits; its exit code."""
        with self._lock:
            process = self._process
        if process is None:
            return None
        process.join()
        return process.exitcode

    def kill_engine(self) -> None:
        with self._lock:
            process, ranks, self._ranks = self._process, self._ranks, []
            self._rendezvous = None
        if process is not None and process.is_alive():
            process.kill()
            process.join(SHUTDOWN_TIMEOUT_S)
        for actor in ranks:  # blocked in a collective with a rank 0 that is gone
            ray.kill(actor, no_restart=True)


class TPRank:
    """A follower rank (> 0) of a replica's tp group, on whichever node its bundle is.
    Threaded, so that node_id answers while run holds a thread for the engine's life."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, config: EngineConfig, rank: int, init_method: str) -> None:
        from specserve.engine.tp import run_follower  # torch only where a rank runs

        run_follower(config, rank, init_method, local_ranks=False)


TPRankActor = ray.remote(max_restarts=0, max_concurrency=2)(TPRank)
# Threads: wait_engine holds one for the engine's life; start/kill take others.
ReplicaHostActor = ray.remote(max_restarts=-1, max_concurrency=4)(ReplicaHost)


class RayEngine(EngineHandle):
    """An engine that a ReplicaHost started, seen from the server."""

    def __init__(self, index: int, host, started: "ray.ObjectRef"):
        self.index = index
        self.host = host
        self.description = f"replica {index}, starting"
        self._started = started
        self._exited = asyncio.Event()
        self._waiter: Optional[asyncio.Task] = None  # held, or the loop may collect it

    def watch_exit(self, on_exit: Callable[[str], None]) -> None:
        self._waiter = asyncio.get_running_loop().create_task(self._wait(on_exit))

    async def _wait(self, on_exit: Callable[[str], None]) -> None:
        try:
            started: EngineStarted = await self._started
            self.description = (f"replica {self.index}: pid {started.pid} on {started.node_ip}, "
                                f"actor pid {started.host_pid}")
            if started.rank_nodes:
                self.description += f", tp ranks on nodes {', '.join(started.rank_nodes)}"
            logger.info("engine process started (%s)", self.description)
            code = await self.host.wait_engine.remote()
            reason = f"engine process exited with code {code}"
        except ray.exceptions.RayError as e:
            # The actor died (node lost, killed): its engine went with it; Ray restarts it.
            reason = f"replica actor failed: {type(e).__name__}: {str(e).splitlines()[0]}"
        self._exited.set()
        on_exit(f"replica {self.index}: {reason}")

    async def stop(self) -> None:
        try:
            await asyncio.wait_for(self._exited.wait(), SHUTDOWN_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("replica %d: the engine did not exit; killing it", self.index)
            await self.kill()

    async def kill(self) -> None:
        try:
            await self.host.kill_engine.remote()
        except ray.exceptions.RayError:
            pass  # the actor is gone, and its engine with it


class RayLauncher(EngineLauncher):
    """Starts replica `index`'s engines in its host actor; the server binds on its node's IP."""

    def __init__(self, index: int, host, rank_actors: bool, bind_host: str):
        self.index = index
        self.host = host
        self.rank_actors = rank_actors
        self.bind_host = bind_host

    def launch(self, config: EngineConfig, link: ServerLinks,
               start_engine: Optional[StartEngine]) -> EngineHandle:
        started = self.host.start_engine.remote(config, link, start_engine, self.rank_actors)
        return RayEngine(self.index, self.host, started)


def place_replicas(cluster: ClusterConfig, config: EngineConfig) -> list[RayLauncher]:
    """Join (or start) Ray and place one host actor per replica. Blocking (ray.init, waiting
    for the placement groups' resources): run it off the event loop."""
    if not ray.is_initialized():
        ray.init(address=cluster.ray_address, namespace=RAY_NAMESPACE, include_dashboard=False,
                 log_to_driver=True)
    gpus_per_rank = cluster.gpus_per_rank
    if gpus_per_rank is None:
        gpus_per_rank = 0 if config.device == "cpu" or not ray.cluster_resources().get("GPU") else 1
    rank_actors = cluster.tp_placement is not TPPlacement.NODE
    if rank_actors:
        bundles = [{"CPU": 1, "GPU": gpus_per_rank}] * config.tp_size
        strategy = "STRICT_SPREAD" if cluster.tp_placement is TPPlacement.SPREAD else "PACK"
    else:
        bundles = [{"CPU": config.tp_size, "GPU": gpus_per_rank * config.tp_size}]
        strategy = "PACK"
    bundles = [{k: v for k, v in bundle.items() if v} for bundle in bundles]
    # Unnamed: several servers may share one cluster.
    groups = [placement_group(bundles, strategy=strategy) for _ in range(cluster.data_parallel)]
    for i, group in enumerate(groups):
        if not group.wait(timeout_seconds=10):
            logger.warning("replica %d waits for Ray resources: %s (%s)", i, bundles, strategy)
            ray.get(group.ready())
    bind_host = ray.util.get_node_ip_address()
    launchers = []
    for i, group in enumerate(groups):
        first = bundles[0]
        host = ReplicaHostActor.options(
            num_cpus=first.get("CPU", 0), num_gpus=first.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        ).remote(i)
        launchers.append(RayLauncher(i, host, rank_actors, bind_host))
    logger.info("placed %d replicas on Ray (%s, bundles %s, %s)", cluster.data_parallel,
                ray.get_runtime_context().gcs_address, bundles, strategy)
    return launchers


def disconnect() -> None:
    """Leave Ray (stopping it if this process started it): the replica actors go with this
    driver. Explicit, before the event loop closes, so that no Ray callback is left to fire into
    it while the interpreter exits."""
    ray.shutdown()
