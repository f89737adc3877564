"""ServerConfig: how the gRPC front-end listens and what it admits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_NEW_TOKENS = 128  # the API's documented default for an unset max_new_tokens


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051               # 0: any free port (the bound one is logged)
    metrics_port: Optional[int] = None  # HTTP /metrics (Prometheus) and /health; None: off
    # The OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...); None: off.
    # Needs the `http` extra (FastAPI, uvicorn).
    http_port: Optional[int] = None
    tls_cert: Optional[str] = None  # PEM paths; both or neither
    tls_key: Optional[str] = None
    # Generate calls admitted beyond the engine's max_running_requests; more are refused with
    # RESOURCE_EXHAUSTED rather than queued without bound.
    max_queue: int = 1024
    max_prompt_tokens: Optional[int] = None   # None: the model's context length - 1
    max_new_tokens_cap: Optional[int] = None  # None: the model's context length - 1
    max_message_bytes: int = 16 * 1024 * 1024  # largest request message (HTTP body) accepted
    # The HTTP front (server/fronts/openai/connections.py): a request's headers must arrive within
    # http_header_timeout_s of its connection opening (or of the previous response ending), and
    # its body within http_body_timeout_s of its headers; a slower client is cut off.
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 60.0
    # Open HTTP connections at most; more are answered 503 and closed at once. None: half the
    # process's file-descriptor limit (RLIMIT_NOFILE), the rest left to gRPC and the workers.
    http_max_connections: Optional[int] = None
    drain_timeout_s: float = 30.0   # on SIGTERM: how long in-flight calls may take to finish
    stats_log_interval_s: float = 10.0  # a throughput/queue/KV log line this often while busy
    engine_start_timeout_s: float = 1800.0  # weight loading + warm-up before giving up
    reflection: bool = True         # gRPC server reflection (grpcurl without .proto files)
    # The engine watchdog (server/ops/watchdog.py says what each timeout catches). No heartbeat for
    # this long: the engine process is frozen. Short, since the heartbeat thread beats on during
    # the longest step; 4 s plus a check interval notices a frozen engine within 5 s.
    engine_heartbeat_timeout_s: float = 4.0
    # Heartbeats arrive but the engine's loop finished no step for this long: it is stuck (a
    # deadlock, a hung collective or GPU). Must exceed the longest legitimate step (the first
    # compile of a kernel for a new shape, the largest prefill); None: off.
    engine_stall_timeout_s: Optional[float] = 300.0
    # Chat outputs: "deepseek-r1" | "qwen3" puts <think>...</think> in reasoning_content (and a
    # grammar applies after it); None: off. Tool-call format "hermes" | "llama3_json"; None:
    # chosen from the model's chat template (server/text/tool_calls.py).
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    # Processes that prepare requests (chat templates, tokenising, validation), out of the
    # server's GIL (server/workers/tokenizer_pool.py); 0: threads of the server process.
    tokenizer_workers: int = 2
    # A stream's chunks after its first carry at least this many tokens (its last may carry
    # fewer): the detokenizer worker holds them until then. Each chunk costs the event loop
    # about the same whatever it carries (routing, a gRPC write), so under load a larger
    # interval serves more tokens per core, at the price of a coarser stream (SGLang's and
    # vLLM's --stream-interval). 1: every engine step's tokens at once.
    stream_interval: int = 1

    def __post_init__(self):
        from specserve.server.text.reasoning import check_reasoning_parser
        from specserve.server.text.tool_calls import check_tool_call_parser

        check_reasoning_parser(self.reasoning_parser)
        check_tool_call_parser(self.tool_call_parser)
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:  # gRPC would bind value % 65536
                raise ValueError(f"{name}: must be a port number in 0..65535, got {value}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert/tls_key: give both or neither")
        if self.tokenizer_workers < 0:
            raise ValueError(f"tokenizer_workers: must be >= 0, got {self.tokenizer_workers}")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval: must be an integer >= 1, got "
                             f"{self.stream_interval!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue: must be >= 0, got {self.max_queue}")
        for name in ("max_prompt_tokens", "max_new_tokens_cap"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if not self.stats_log_interval_s > 0:
            raise ValueError(f"stats_log_interval_s: must be > 0, got {self.stats_log_interval_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes: must be >= 1024, got {self.max_message_bytes}")
        for name in ("http_header_timeout_s", "http_body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.http_max_connections is not None and self.http_max_connections < 1:
            raise ValueError(f"http_max_connections: must be >= 1, got {self.http_max_connections}")
        if not self.engine_heartbeat_timeout_s > 0:
            raise ValueError(f"engine_heartbeat_timeout_s: must be > 0, got "
                             f"{self.engine_heartbeat_timeout_s}")
        if self.engine_stall_timeout_s is not None and not self.engine_stall_timeout_s > 0:
            raise ValueError(f"engine_stall_timeout_s: must be > 0 (or None: off), got "
                             f"{self.engine_stall_timeout_s}")
