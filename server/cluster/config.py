"""ClusterConfig: how many engine replicas, where Ray places them, and how requests are routed."""
from __future__ import annotations

import enum
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Optional

from specserve.engine.config import EngineConfig
from specserve.server.cluster.routing import RoutingConfig

INSTALL_HINT = "install Ray with: pip install 'specserve[ray]'"


class TPPlacement(enum.Enum):
    """Where a replica's tensor-parallel ranks run."""

    # One Ray actor (one bundle of tp GPUs) per replica; it spawns the ranks on its node, as a
    # single engine does. NCCL stays inside one host.
    NODE = "node"
    # One Ray actor per rank (a bundle of one GPU each) in a PACK placement group: the group
    # spans nodes only when no one node has tp GPUs free.
    PACK = "pack"
    # STRICT_SPREAD: every rank on a node of its own (multi-node tp on purpose, and its test).
    SPREAD = "spread"


@dataclass(frozen=True)
class ClusterConfig:
    data_parallel: int = 1
    ray_address: Optional[str] = None  # None: start a local Ray (or join RAY_ADDRESS if set)
    tp_placement: TPPlacement = TPPlacement.NODE
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # GPUs Ray reserves per tp rank; None: 1 when the cluster has GPUs and the device is not
    # cpu, else 0. A fraction puts several small replicas on one GPU, each engine's
    # gpu_memory_utilization scaled by it (replica_engine_config), so that they fit together.
    gpus_per_rank: Optional[float] = None
    # A replica that died is started again after this long (then doubled per restart in a row
    # without serving, up to max_restart_backoff_s), so a crash loop does not spin.
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 60.0
    # Front processes serving the public port(s) together (SO_REUSEPORT), each with its own
    # clients to every replica, under one supervising parent (front_processes.py): one Python
    # process's event loop cannot feed many replicas. 1: the server process is the front.
    front_processes: int = 1

    def __post_init__(self):
        for name in ("data_parallel", "front_processes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if not isinstance(self.tp_placement, TPPlacement):
            raise ValueError(f"tp_placement: one of {[p.value for p in TPPlacement]}, "
                             f"got {self.tp_placement!r}")
        if self.gpus_per_rank is not None and not self.gpus_per_rank >= 0:
            raise ValueError(f"gpus_per_rank: must be >= 0, got {self.gpus_per_rank}")
        if not 0 < self.restart_backoff_s <= self.max_restart_backoff_s:
            raise ValueError(f"restart_backoff_s: must be > 0 and <= max_restart_backoff_s, got "
                             f"{self.restart_backoff_s}")


def replica_engine_config(config: EngineConfig, index: int,
                          gpus_per_rank: Optional[float] = None) -> EngineConfig:
    """Replica `index`'s engine config. On a fraction of a GPU (`gpus_per_rank` below 1) its
    gpu_memory_utilization is the user's times that fraction: two replicas of 0.5 take what one
    engine would. A --kv-events-endpoint (and replay endpoint) of the user's moves up by the
    index (port + index; ipc://: the path suffixed -index), as vLLM's data-parallel ranks do,
    so that replicas on one node do not share it; a --step-log gets the index before its
    extension (steps.1.jsonl). ValueError naming the field when a port passes 65535, or for a
    fraction of a GPU per rank with --tp (two ranks of one engine on one GPU)."""
    if gpus_per_rank is not None and 0 < gpus_per_rank < 1:
        if config.tp_size > 1:
            raise ValueError(f"gpus_per_rank (--gpus-per-rank): {gpus_per_rank:g} would put "
                             f"tensor-parallel ranks of one replica on one GPU; with --tp "
                             f"{config.tp_size} give 1 (or more)")
        config = config.replace(
            gpu_memory_utilization=config.gpu_memory_utilization * gpus_per_rank)
    if config.step_log is not None and index > 0:  # each replica's engine writes a log of its own
        root, ext = os.path.splitext(config.step_log)
        config = config.replace(step_log=f"{root}.{index}{ext}")
    if config.kv_events_endpoint is None or index == 0:
        return config
    try:
        return config.replace(
            kv_events_endpoint=_offset_endpoint(config.kv_events_endpoint, index),
            kv_events_replay_endpoint=None if config.kv_events_replay_endpoint is None
            else _offset_endpoint(config.kv_events_replay_endpoint, index))
    except ValueError as e:
        raise ValueError(f"{e} (data-parallel replica {index} publishes at the port + {index})") from e


def _offset_endpoint(endpoint: str, by: int) -> str:
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-{by}"
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + by}"


def require_ray() -> None:
    """Raise ImportError saying what to install unless Ray is installed (found, not imported:
    ray_replicas.py sets Ray's environment before the import)."""
    if importlib.util.find_spec("ray") is None:
        raise ImportError(f"data-parallel replicas run on Ray, which is not installed; "
                          f"{INSTALL_HINT}")
