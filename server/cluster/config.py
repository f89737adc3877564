"""ClusterConfig: how many engine replicas, where Ray places them, and how requests are routed."""
from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass, field
from typing import Optional

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
    # cpu, else 0. A fraction puts several small replicas on one GPU (then give each engine a
    # KV pool that fits its share: EngineConfig.max_total_tokens).
    gpus_per_rank: Optional[float] = None
    # A replica that died is started again after this long (then doubled per restart in a row
    # without serving, up to max_restart_backoff_s), so a crash loop does not spin.
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 60.0

    def __post_init__(self):
        if not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise ValueError(f"data_parallel: must be >= 1, got {self.data_parallel}")
        if not isinstance(self.tp_placement, TPPlacement):
            raise ValueError(f"tp_placement: one of {[p.value for p in TPPlacement]}, "
                             f"got {self.tp_placement!r}")
        if self.gpus_per_rank is not None and not self.gpus_per_rank >= 0:
            raise ValueError(f"gpus_per_rank: must be >= 0, got {self.gpus_per_rank}")
        if not 0 < self.restart_backoff_s <= self.max_restart_backoff_s:
            raise ValueError(f"restart_backoff_s: must be > 0 and <= max_restart_backoff_s, got "
                             f"{self.restart_backoff_s}")


def require_ray() -> None:
    """Raise ImportError saying what to install unless Ray is installed (found, not imported:
    ray_replicas.py sets Ray's environment before the import)."""
    if importlib.util.find_spec("ray") is None:
        raise ImportError(f"data-parallel replicas run on Ray, which is not installed; "
                          f"{INSTALL_HINT}")
