"""The Generation service's method handlers, with request bytes that fail to decode turned
into INVALID_ARGUMENT (grpc's own handlers answer UNKNOWN, naming an internal class)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from async_engine.v1 import generation_pb2 as pb

SERVICE = "async_engine.v1.Generation"
# method -> (request type, response type, server-streaming)
METHODS = {
    "Generate": (pb.GenerateRequest, pb.GenerateResponse, True),
    "Abort": (pb.AbortRequest, pb.AbortResponse, False),
    "GetModelInfo": (pb.GetModelInfoRequest, pb.ModelInfo, False),
    "GetLoad": (pb.GetLoadRequest, pb.Load, False),
}


@dataclass(slots=True)
class Undecodable:
    """What a request that is not valid protobuf becomes, so the handler can refuse it."""

    error: str


def _tolerant(request_type: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return request_type.FromString(data)
        except Exception as exc:  # protobuf's DecodeError, or worse bytes
            return Undecodable(f"the request is not a valid {request_type.__name__}: {exc}")

    return decode


def _guarded(method: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
    if streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            async for message in method(request, context):
                yield message

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await method(request, context)

    return unary


def add_generation_service(servicer: Any, server: grpc.aio.Server) -> None:
    handlers = {}
    for name, (request_type, response_type, streaming) in METHODS.items():
        make = (
            grpc.unary_stream_rpc_method_handler
            if streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = make(
            _guarded(getattr(servicer, name), streaming),
            request_deserializer=_tolerant(request_type),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
