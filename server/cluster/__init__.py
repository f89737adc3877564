"""Data-parallel engine replicas on Ray, routed by prefix affinity (docs/architecture.md,
"Past one GPU and one machine"). The Python entry:

    from specserve.server.app import run_server
    from specserve.server.cluster import ClusterConfig
    run_server(engine_config, server_config, cluster=ClusterConfig(data_parallel=2))

Only ray_replicas.py imports Ray (the optional `ray` extra), and only once replicas start."""
from specserve.server.cluster.config import ClusterConfig, TPPlacement
from specserve.server.cluster.routing import RoutingConfig, RoutingPolicy

__all__ = ["ClusterConfig", "RoutingConfig", "RoutingPolicy", "TPPlacement"]
