"""Prometheus metrics of the gRPC server (served over HTTP when --metrics-port is given)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specserve.server.proto import engine_ipc_pb2 as ipc

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    """One registry per server, so that several servers can live in one process (tests)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specserve_requests", "Generate calls by final status code",
                                ["code"], registry=r)
        self.generated_tokens = Counter("specserve_generated_tokens",
                                        "Tokens streamed to clients", registry=r)
        self.time_to_first_token = Histogram("specserve_time_to_first_token_seconds",
                                             "From the call's arrival to its first token",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.request_duration = Histogram("specserve_request_duration_seconds",
                                          "From the call's arrival to its end",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.active_streams = Gauge("specserve_active_streams",
                                    "Generate calls admitted and not finished", registry=r)
        self.num_running = Gauge("specserve_engine_running_requests",
                                 "Requests the engine is decoding", registry=r)
        self.num_waiting = Gauge("specserve_engine_waiting_requests",
                                 "Requests waiting for an engine slot", registry=r)
        self.kv_used_tokens = Gauge("specserve_kv_used_tokens", "KV-cache slots in use", registry=r)
        self.kv_total_tokens = Gauge("specserve_kv_total_tokens", "KV-cache slots in all",
                                     registry=r)
        self.mean_accept_length = Gauge("specserve_mean_accept_length",
                                        "Mean tokens emitted per verify step since the engine started", registry=r)

    def serve_http(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def observe_load(self, load: ipc.LoadReport) -> None:
        self.num_running.set(load.num_running)
        self.num_waiting.set(load.num_waiting)
        self.kv_used_tokens.set(load.kv_used_tokens)
        self.kv_total_tokens.set(load.kv_total_tokens)
        self.mean_accept_length.set(load.mean_accept_length)
