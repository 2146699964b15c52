"""gRPC errors with google.rpc details: the only way the server reports a failed request.

Engine validation raises ``ValueError("<field> ...")``; this module turns the field name
into the path of the proto field the client set (``sampling.temperature``), so that a
``BadRequest`` field violation points at what to fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from async_engine.server.sampling_fields import PLACES

DOMAIN = "async-engine"

# Engine field name -> where that value lives in a GenerateRequest: every SamplingParams
# field (placed on the proto descriptor by name), and a chat's messages.
_FIELD_PATHS = {
    **{name: where.path for name, where in PLACES.items()},
    "messages": "chat.messages",
}

_LEADING_NAME = re.compile(r"([A-Za-z_]\w*)((?:\[\d+\])?(?:\.\w+)*)")


@dataclass(slots=True)
class RpcFailure(Exception):
    """Raised inside a handler; the servicer turns it into the call's final status."""

    code: grpc.StatusCode
    message: str
    details: list[Message] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def to_status(self) -> grpc.Status:
        packed = []
        for detail in self.details:
            any_msg = any_pb2.Any()
            any_msg.Pack(detail)
            packed.append(any_msg)
        proto = status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)
        return rpc_status.to_status(proto)


def field_path(message: str, prompt_field: str = "prompt") -> str:
    """The proto path of the field an engine error message starts with."""
    match = _LEADING_NAME.match(message)
    if match is None:
        return ""
    name, rest = match.group(1), match.group(2)
    if name == "prompt":
        return prompt_field + rest
    return _FIELD_PATHS.get(name, name) + rest


def invalid_argument(
    message: str, field_name: str | None = None, *, prompt_field: str = "prompt"
) -> RpcFailure:
    path = field_name if field_name is not None else field_path(message, prompt_field)
    violation = error_details_pb2.BadRequest.FieldViolation(field=path, description=message)
    return RpcFailure(
        grpc.StatusCode.INVALID_ARGUMENT,
        message,
        [error_details_pb2.BadRequest(field_violations=[violation])],
    )


def already_exists(request_id: str) -> RpcFailure:
    info = error_details_pb2.ResourceInfo(
        resource_type="request", resource_name=request_id, description="already in flight"
    )
    return RpcFailure(
        grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight", [info]
    )


def resource_exhausted(message: str, reason: str, retry_after_s: float = 1.0) -> RpcFailure:
    # RetryInfo tells a router it may try again (here or elsewhere) after a short pause.
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_after_s * 1e9))
    return RpcFailure(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        message,
        [
            error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN),
            error_details_pb2.RetryInfo(retry_delay=delay),
        ],
    )


def unavailable(message: str, reason: str = "DRAINING") -> RpcFailure:
    return RpcFailure(
        grpc.StatusCode.UNAVAILABLE,
        message,
        [error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN)],
    )


def permission_denied(message: str, field_name: str) -> RpcFailure:
    violation = error_details_pb2.BadRequest.FieldViolation(field=field_name, description=message)
    return RpcFailure(
        grpc.StatusCode.PERMISSION_DENIED,
        message,
        [
            error_details_pb2.ErrorInfo(reason="NOT_ALLOWED_FOR_TOKEN", domain=DOMAIN),
            error_details_pb2.BadRequest(field_violations=[violation]),
        ],
    )


def unauthenticated(reason: str) -> RpcFailure:
    return RpcFailure(
        grpc.StatusCode.UNAUTHENTICATED,
        "a valid 'authorization: Bearer <token>' metadata entry is required",
        [error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN)],
    )


def internal(message: str, request_id: str) -> RpcFailure:
    return RpcFailure(
        grpc.StatusCode.INTERNAL,
        message,
        [
            error_details_pb2.ErrorInfo(reason="STEP_FAILED", domain=DOMAIN),
            error_details_pb2.RequestInfo(request_id=request_id),
        ],
    )
