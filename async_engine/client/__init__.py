"""Python clients of the gRPC service: ``AsyncClient`` and ``Client``, with typed events and errors."""

from async_engine.client.grpc_client import AsyncClient, Client
from async_engine.client.messages import build_request
from async_engine.client.types import (
    Accepted,
    AlreadyExists,
    Cancelled,
    Chunk,
    DeadlineExceeded,
    EngineError,
    Event,
    Finished,
    InternalError,
    InvalidArgument,
    Load,
    ModelInfo,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "Accepted",
    "AlreadyExists",
    "AsyncClient",
    "Cancelled",
    "Chunk",
    "Client",
    "DeadlineExceeded",
    "EngineError",
    "Event",
    "Finished",
    "InternalError",
    "InvalidArgument",
    "Load",
    "ModelInfo",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "build_request",
]
