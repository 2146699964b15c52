"""What an operator sets for a server: addresses, TLS, auth, limits and timeouts."""

from __future__ import annotations

from dataclasses import dataclass, field

from async_engine.server.codec import Limits


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"  # loopback unless the operator opens it up
    port: int = 50051  # 0: any free port (see GenerationServer.port)
    metrics_port: int | None = 9400  # None: no /metrics endpoint; 0: any free port
    drain_timeout_s: float = 30.0
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None  # one unrestricted principal
    auth_token_file: str | None = None  # tokens -> principals (see server.auth)
    max_message_bytes: int = 4 << 20  # gRPC rejects larger requests with RESOURCE_EXHAUSTED
    limits: Limits = field(default_factory=Limits)
    metrics_interval_s: float = 0.25
    stream_idle_timeout_s: float = 60.0  # a stream whose write stalls this long is cancelled
    warmup: bool = True
    http_port: int | None = None  # the OpenAI-compatible HTTP API; None: off, 0: any free port
    http_host: str | None = None  # default: ``host``
    http_header_timeout_s: float = 10.0  # a request's headers must be whole in this time
    http_body_timeout_s: float = 30.0  # and its body, once the headers are in

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError(
                "auth_token and auth_token_file are exclusive: put the token in the file"
            )
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        for name in ("http_header_timeout_s", "http_body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
