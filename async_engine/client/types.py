"""What the clients yield and raise: plain dataclasses, no protobuf types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message


@dataclass(slots=True)
class Accepted:
    seq: int
    request_id: str
    prompt_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Chunk:
    seq: int
    index: int
    offset: int  # output position of token_ids[0]
    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With prompt_logprobs, on a choice's first chunk: per prompt token after the first,
    # (logprob, rank, top-n (id, logprob)).
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] = field(default_factory=list)


@dataclass(slots=True)
class Finished:
    seq: int
    index: int
    reason: str  # "eos" | "stop" | "length" | "context_length" | "aborted" | "time_limit"
    stop_token_id: int | None
    stop_str: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_s: float
    ttft_s: float
    e2e_s: float


Event = Accepted | Chunk | Finished


@dataclass(slots=True)
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    device: str

    @classmethod
    def from_pb(cls, m: Any) -> ModelInfo:
        return cls(m.model, m.max_model_len, m.vocab_size, list(m.eos_token_ids), m.dtype, m.device)


@dataclass(slots=True)
class Load:
    running: int
    waiting: int
    kv_usage: float
    free_blocks: int
    total_blocks: int
    device_state: str = "serving"  # serving | restarting | failed
    device_restarts: int = 0
    tenants: dict[str, tuple[int, int]] = field(default_factory=dict)  # -> (waiting, running)

    @classmethod
    def from_pb(cls, m: Any) -> Load:
        tenants = {t.tenant: (t.waiting, t.running) for t in m.tenants}
        return cls(
            m.running,
            m.waiting,
            m.kv_usage,
            m.free_blocks,
            m.total_blocks,
            m.device_state,
            m.device_restarts,
            tenants,
        )


class EngineError(Exception):
    """A failed RPC: its gRPC status code, message and google.rpc details."""

    def __init__(
        self, code: grpc.StatusCode, message: str, details: list[Message] | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.details = details or []

    def detail(self, cls: type[Message]) -> Any:
        """The first attached detail of this type (e.g. BadRequest), or None."""
        return next((d for d in self.details if isinstance(d, cls)), None)

    @property
    def field_violations(self) -> dict[str, str]:
        """BadRequest field path -> description."""
        out: dict[str, str] = {}
        for d in self.details:
            for v in getattr(d, "field_violations", ()):
                out[v.field] = v.description
        return out

    @property
    def reason(self) -> str | None:
        """ErrorInfo.reason (QUEUE_FULL, QUEUE_TIMEOUT, DRAINING, BAD_TOKEN, STEP_FAILED...)."""
        for d in self.details:
            if d.DESCRIPTOR.name == "ErrorInfo":
                return d.reason
        return None


class InvalidArgument(EngineError):
    pass


class AlreadyExists(EngineError):
    pass


class ResourceExhausted(EngineError):
    pass


class Unavailable(EngineError):
    pass


class Unauthenticated(EngineError):
    pass


class PermissionDenied(EngineError):
    pass


class InternalError(EngineError):
    pass


class DeadlineExceeded(EngineError):
    pass


class Cancelled(EngineError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[EngineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def error_from_status(code: grpc.StatusCode, message: str, details: list[Message]) -> EngineError:
    return _BY_CODE.get(code, EngineError)(code, message, details)
