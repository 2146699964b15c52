"""Bearer-token authentication for every RPC except health checks (probes carry no token)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from async_engine.server.errors import unauthenticated

_OPEN_PREFIX = "/grpc.health.v1.Health/"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIX):
            return handler
        reason = self._check(details.invocation_metadata or ())
        if reason is None:
            return handler
        return _rejecting(handler, reason)

    def _check(self, metadata: Any) -> str | None:
        values = [v for k, v in metadata if k == "authorization"]
        if not values:
            return "MISSING_TOKEN"
        given = values[0].encode() if isinstance(values[0], str) else values[0]
        # Constant time: the comparison must not reveal how much of a guess was right.
        return None if hmac.compare_digest(given, self._expected) else "BAD_TOKEN"


def _rejecting(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    status = unauthenticated(reason).to_status()

    async def reject(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort_with_status(status)

    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(reject, **codec)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(reject, **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(reject, **codec)
    return grpc.stream_stream_rpc_method_handler(reject, **codec)
