"""Per-replica Prometheus metrics (label `replica`), read from the replica set when scraped;
the server's own metrics (server/ops/metrics.py) carry the totals."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.server.cluster.replica_set import ReplicaSet
from specserve.server.ops.watchdog import WatchdogState

# (metric suffix, EngineLoad field, help): from the latest load query (polled every few s).
_LOAD_GAUGES = (
    ("running_requests", "num_running", "Requests the replica's engine is decoding"),
    ("waiting_requests", "num_waiting", "Requests waiting for a slot in the replica's engine"),
    ("kv_used_tokens", "kv_used_tokens", "The replica's KV-cache slots in use"),
    ("kv_total_tokens", "kv_total_tokens", "The replica's KV-cache slots in all"),
    ("kv_cached_tokens", "kv_cached_tokens", "KV-cache slots the replica's prefix cache holds"),
)


class ReplicaCollector(Collector):
    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        replicas = self.replicas.replicas
        serving = GaugeMetricFamily("specserve_replica_serving",
                                    "1 while the replica takes requests", labels=["replica"])
        streams = GaugeMetricFamily("specserve_replica_active_streams",
                                    "Generate calls routed to the replica and not finished",
                                    labels=["replica"])
        restarts = CounterMetricFamily("specserve_replica_restarts",
                                       "Times the replica's engine was started again",
                                       labels=["replica"])
        steps = CounterMetricFamily("specserve_replica_engine_steps",
                                    "Engine steps the replica reported", labels=["replica"])
        step_seconds = CounterMetricFamily(
            "specserve_replica_engine_step_seconds",
            "Seconds the replica's engine steps took (the host's view, as "
            "specserve_engine_step_seconds): against the wall clock, how busy it was kept",
            labels=["replica"])
        watchdog = GaugeMetricFamily("specserve_replica_watchdog",
                                     "The replica's engine watchdog state (1 for the current one)",
                                     labels=["replica", "state"])
        for r in replicas:
            label = str(r.index)
            serving.add_metric([label], float(r.serving))
            streams.add_metric([label], r.active_streams)
            restarts.add_metric([label], r.restarts)
            steps.add_metric([label], r.steps)
            step_seconds.add_metric([label], r.step_seconds)
            state = r.client.watchdog.state if r.client is not None else WatchdogState.STARTING
            for s in WatchdogState:
                watchdog.add_metric([label, s.value], float(s is state))
        yield from (serving, streams, restarts, watchdog, steps, step_seconds)
        routed = CounterMetricFamily("specserve_replica_routed_requests",
                                     "Requests routed to the replica, by why (affinity: it held "
                                     "the longest prefix; least_loaded)",
                                     labels=["replica", "reason"])
        for (index, reason), count in sorted(self.replicas.routed.items()):
            routed.add_metric([str(index), reason], count)
        yield routed
        for suffix, field, help_text in _LOAD_GAUGES:
            gauge = GaugeMetricFamily(f"specserve_replica_{suffix}", help_text, labels=["replica"])
            for row in self.replicas.last_rows:
                if row.load is not None:
                    gauge.add_metric([str(row.replica)], getattr(row.load, field))
            yield gauge
