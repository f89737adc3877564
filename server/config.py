"""ServerConfig: how the gRPC front-end listens and what it admits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_NEW_TOKENS = 128  # the API's documented default for an unset max_new_tokens


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051               # 0: any free port (the bound one is logged)
    metrics_port: Optional[int] = None  # Prometheus /metrics over HTTP; None: off
    tls_cert: Optional[str] = None  # PEM paths; both or neither
    tls_key: Optional[str] = None
    # Generate calls admitted beyond the engine's max_running_requests; more are refused with
    # RESOURCE_EXHAUSTED rather than queued without bound.
    max_queue: int = 1024
    max_prompt_tokens: Optional[int] = None   # None: the model's context length - 1
    max_new_tokens_cap: Optional[int] = None  # None: the model's context length - 1
    max_message_bytes: int = 16 * 1024 * 1024  # largest request message accepted
    drain_timeout_s: float = 30.0   # on SIGTERM: how long in-flight calls may take to finish
    engine_start_timeout_s: float = 1800.0  # weight loading + warm-up before giving up

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert/tls_key: give both or neither")
        if self.max_queue < 0:
            raise ValueError(f"max_queue: must be >= 0, got {self.max_queue}")
        for name in ("max_prompt_tokens", "max_new_tokens_cap"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes: must be >= 1024, got {self.max_message_bytes}")
