"""Prometheus metrics of the server, both fronts together (served on /metrics of --metrics-port
and --http-port)."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric, StateSetMetricFamily
from prometheus_client.registry import Collector

from specserve.engine.config import SpecConfig
from specserve.engine.outputs import EngineLoad, GrammarHealth, StepStat
from specserve.server.ops.watchdog import WatchdogReport, WatchdogState
from specserve.server.request_record import TTFT_STAGES, RequestRecord

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Between tokens: a decode step takes milliseconds to a few tens of them.
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25,
                          0.5, 1, 2.5)

# Stages of a request's TTFT and engine steps: 0.1 ms to a minute, five buckets a decade
# (bench/serving.py interpolates p50s from them).
_STAGE_BUCKETS = tuple(round(m * 10.0 ** e, 6) for e in range(-4, 2) for m in (1, 2, 3, 5, 7)) + (100,)
_EXTEND_TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class _WatchdogCollector(Collector):
    """The engine watchdog's state, read when scraped (so never stale)."""

    def __init__(self, report: Callable[[], WatchdogReport]):
        self.report = report

    def collect(self) -> Iterator[Metric]:
        report = self.report()
        yield StateSetMetricFamily(
            "specserve_engine_watchdog", "The engine watchdog's verdict (1 for the current one)",
            value={state.value: state is report.state for state in WatchdogState})
        yield GaugeMetricFamily("specserve_engine_heartbeat_age_seconds",
                                "Since the engine process's last heartbeat",
                                value=report.heartbeat_age_s)
        yield GaugeMetricFamily("specserve_engine_loop_stall_seconds",
                                "Since the engine's main loop last completed an iteration",
                                value=report.loop_stall_s)


class ServerMetrics:
    """One registry per server, so that several servers can live in one process (tests).

    Generate calls are counted by final status code, refusals included (malformed and oversized
    fields too). A message over max_message_bytes is refused by gRPC itself before any server
    code sees it, so those refusals are not counted.
    """

    def __init__(self, watchdog_report: Callable[[], WatchdogReport]):
        self.registry = CollectorRegistry()
        r = self.registry
        # CPU, memory, open files: what the default registry has and a private one lacks.
        ProcessCollector(registry=r)
        self.requests = Counter("specserve_requests", "Generate calls by final status code",
                                ["code"], registry=r)
        self.generated_tokens = Counter("specserve_generated_tokens",
                                        "Tokens streamed to clients", registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens",
                                     "Prompt tokens of the requests sent to the engine",
                                     registry=r)
        self.finished_requests = Counter(
            "specserve_finished_requests",
            "Choices (sequences; a request has n) that ended, by finish reason: stop, length, or "
            "error (failed mid-generation, e.g. the grammar service died); not those refused or "
            "cancelled",
            ["finish_reason"], registry=r)
        self.queue_time = Histogram(
            "specserve_queue_time_seconds",
            "From a call's admission to the engine's first output for it: preparing it, waiting "
            "for an engine slot and the prefill (the engine reports no time of scheduling)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "specserve_inter_token_latency_seconds",
            "Between a request's successive streamed chunks of tokens (a speculative step's "
            "chunk can carry several tokens)", buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "specserve_time_per_output_token_seconds",
            "A request's mean time per token after its first (observed when it ends)",
            buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        # Counters rather than a mean, so that rate() gives the accept rate over any window:
        # accepted drafts per verify step.
        self.spec_verify_steps = Counter(
            "specserve_spec_verify_steps",
            "Target-model verify forwards, summed over requests (counted when a request ends)",
            registry=r)
        self.spec_accepted_draft_tokens = Counter(
            "specserve_spec_accepted_draft_tokens",
            "Draft tokens the target model accepted, summed over requests (counted when a "
            "request ends)", registry=r)
        # The same by drafting method (the engine's --speculative-algorithm), and the draft depth
        # it verifies: what acceptance a method gets on this traffic, at what depth.
        self.spec_method_verify_steps = Counter(
            "specserve_spec_method_verify_steps",
            "Target-model verify forwards by drafting method (counted when a request ends)",
            ["method"], registry=r)
        self.spec_method_accepted_draft_tokens = Counter(
            "specserve_spec_method_accepted_draft_tokens",
            "Draft tokens the target model accepted by drafting method (counted when a request "
            "ends)", ["method"], registry=r)
        self.spec_draft_depth = Gauge(
            "specserve_spec_draft_depth",
            "Draft tokens per request a verify step checks (at most, with adaptive speculation), "
            "by drafting method", ["method"],
            registry=r)
        self.spec_decode_steps = Counter(
            "specserve_spec_decode_steps",
            "Engine decode steps by drafting method and the draft tokens a request they verified "
            "(adaptive speculation's choice per step; 0: a plain step)", ["method", "depth"],
            registry=r)
        self._spec_method: Optional[str] = None  # set once the engine says how it speculates
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
        # What gateways read as a model server's KV utilisation (vLLM: kv_cache_usage_perc,
        # also a ratio); slots the prefix cache holds that nobody uses are reclaimable, free.
        self.kv_cache_usage = Gauge("specserve_kv_cache_usage_ratio",
                                    "KV-cache slots in use over those in all, in [0, 1]",
                                    registry=r)
        # The hit rate over any window is rate(cached) / rate(prompt tokens); the gauge is the
        # engine's own since it started (every prompt position it looked up, retried ones too).
        self.prompt_cached_tokens = Counter(
            "specserve_prompt_cached_tokens",
            "Prompt tokens whose KV came from the prefix cache (counted when a request ends)",
            registry=r)
        self.prefix_cache_hit_rate = Gauge(
            "specserve_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache over those looked up, since the engine "
            "started", registry=r)
        self.kv_cached_tokens = Gauge("specserve_kv_cached_tokens",
                                      "KV-cache slots the prefix cache holds", registry=r)
        self.mean_accept_length = Gauge("specserve_mean_accept_length",
                                        "Mean tokens emitted per verify step since the engine started", registry=r)
        self.retractions = Counter("specserve_engine_retractions",
                                   "Running requests pushed back to the queue to free KV",
                                   registry=r)
        # Where TTFT goes (RequestRecord.TTFT_STAGES), observed when a call's first chunk is
        # written; and what the engine's steps take (engine/outputs.py StepStat).
        self.ttft_stage = Histogram(
            "specserve_ttft_stage_seconds",
            "A request's time to first token by stage: prepare (admission, tokenizer pool), "
            "submit, to_engine (socket and the engine's step in progress), engine_queue (until "
            "its first prefill chunk launches), prefill (until its first token is on the host), "
            "to_server (engine send, reader thread, detokenizer worker), to_consumer (event loop), "
            "write (the front writing the first chunk)", ["stage"], buckets=_STAGE_BUCKETS,
            registry=r)
        self._ttft_stage = {name: self.ttft_stage.labels(name) for name, _, _ in TTFT_STAGES}
        self.engine_step = Histogram(
            "specserve_engine_step_seconds",
            "Engine steps by mode (extend: prefill chunks; decode: a (speculative) decode step), "
            "from launch, or the previous step's result if later, to its result on the host",
            ["mode"], buckets=_STAGE_BUCKETS, registry=r)
        self._engine_step = (self.engine_step.labels("decode"), self.engine_step.labels("extend"))
        self.decode_stall = Histogram(
            "specserve_engine_decode_stall_seconds",
            "Extend steps run while other requests were decoding: the gap they added to those "
            "requests' token streams", buckets=_STAGE_BUCKETS, registry=r)
        self.extend_tokens = Histogram("specserve_engine_extend_tokens",
                                       "Prefill tokens per extend step",
                                       buckets=_EXTEND_TOKEN_BUCKETS, registry=r)
        self._retractions_seen = 0  # the engine reports a running total; the counter takes steps
        # The engine's grammar service (structured outputs), as the engine reports it.
        self.grammar_up = Gauge(
            "specserve_grammar_up",
            "1 while the engine's grammar service (structured outputs) is up and warm, 0 while it "
            "restarts (constrained requests then fail with UNAVAILABLE) or is missing",
            registry=r)
        self.grammar_restarts = Counter(
            "specserve_grammar_restarts", "Times the engine restarted its grammar process after "
            "it died", registry=r)
        self._grammar_restarts_seen = 0
        r.register(_WatchdogCollector(watchdog_report))

    def observe_finished(self, record: RequestRecord) -> None:
        """The per-request metrics that are known once a request has ended."""
        self.requests.labels(record.status).inc()
        self.request_duration.observe(record.duration)
        for reason in record.finish_reasons:  # per choice: n > 1 counts each
            if reason is not None:
                self.finished_requests.labels(reason).inc()
        if record.time_per_output_token is not None:
            self.time_per_output_token.observe(record.time_per_output_token)
        self.spec_verify_steps.inc(record.verify_steps)
        self.spec_accepted_draft_tokens.inc(record.accepted_drafts)
        if self._spec_method is not None:
            self.spec_method_verify_steps.labels(self._spec_method).inc(record.verify_steps)
            self.spec_method_accepted_draft_tokens.labels(self._spec_method).inc(record.accepted_drafts)
        self.prompt_cached_tokens.inc(record.cached_tokens)

    def observe_speculation(self, spec: Optional[SpecConfig]) -> None:
        """The engine's speculative configuration, once it is ready (None: plain decoding)."""
        if spec is not None:
            self._spec_method = spec.algorithm
            self.spec_draft_depth.labels(spec.algorithm).set(spec.num_draft_tokens - 1)

    def observe_ttft_stages(self, record: RequestRecord) -> None:
        for name, seconds in record.ttft_stages().items():
            self._ttft_stage[name].observe(seconds)

    def observe_engine_steps(self, steps: list[StepStat], load: Optional[EngineLoad]) -> None:
        """One batch message's engine steps (a few observations a step) and the load after
        them: the load gauges are never more than one engine step old."""
        for step in steps:
            self._engine_step[step.extend].observe(step.seconds)
            if not step.extend and self._spec_method is not None:
                self.spec_decode_steps.labels(self._spec_method, str(step.draft_depth)).inc()
            if step.extend:
                self.extend_tokens.observe(step.tokens)
                if step.others:
                    self.decode_stall.observe(step.seconds)
        if load is not None:
            self.observe_load(load)

    def observe_grammar(self, health: GrammarHealth) -> None:
        self.grammar_up.set(1 if health.serving else 0)
        if health.restarts > self._grammar_restarts_seen:
            self.grammar_restarts.inc(health.restarts - self._grammar_restarts_seen)
            self._grammar_restarts_seen = health.restarts

    def observe_load(self, load: EngineLoad) -> None:
        self.num_running.set(load.num_running)
        self.num_waiting.set(load.num_waiting)
        self.kv_used_tokens.set(load.kv_used_tokens)
        self.kv_total_tokens.set(load.kv_total_tokens)
        self.kv_cache_usage.set(load.kv_used_tokens / load.kv_total_tokens
                                if load.kv_total_tokens else 0.0)
        self.kv_cached_tokens.set(load.kv_cached_tokens)
        self.prefix_cache_hit_rate.set(load.prefix_cache_hit_rate)
        self.mean_accept_length.set(load.mean_accept_length)
        if load.num_retractions > self._retractions_seen:
            self.retractions.inc(load.num_retractions - self._retractions_seen)
            self._retractions_seen = load.num_retractions
