"""Who is calling: bearer tokens, each mapped to a principal with its allowed tenants and
most urgent priority. Health checks stay open (probes carry no token).

``--auth-token`` makes one unrestricted principal; ``--auth-token-file`` reads many::

    {"tokens": [
        {"token": "s3cret-a", "principal": "search", "tenants": ["search"], "min_priority": 0},
        {"token": "s3cret-b", "principal": "ops"}
    ]}

``tenants`` absent: any tenant; present: the request's tenant must be one of them (an
empty tenant becomes the first). ``min_priority`` absent: any priority; present: a request
may not ask for a smaller (more urgent) one. Request ids are scoped to their principal:
another principal's id is unknown to Abort and never reported as in flight.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from async_engine.server.errors import unauthenticated

_OPEN_PREFIX = "/grpc.health.v1.Health/"
_ENTRY_KEYS = {"token", "principal", "tenants", "min_priority"}


class NotAllowed(ValueError):
    """A request asks for what its principal may not have; ``field`` names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    tenants: tuple[str, ...] | None = None  # None: any tenant
    min_priority: int | None = None  # the most urgent priority it may ask for

    def tenant_for(self, tenant: str) -> str:
        """The tenant a request runs as; NotAllowed if this principal may not use it."""
        if self.tenants is None:
            return tenant
        if not tenant:
            return self.tenants[0]
        if tenant not in self.tenants:
            raise NotAllowed("tenant", f"tenant {tenant[:64]!r} is not allowed for this token")
        return tenant

    def admit(self, tenant: str, priority: int | None) -> tuple[str, int]:
        """The tenant and priority a request runs with, the same on every front end; a
        request that names no priority (an OpenAI client never does) runs at the floor.
        NotAllowed names the field a request may not have."""
        if priority is None:
            priority = max(0, self.min_priority) if self.min_priority is not None else 0
        self.check_priority(priority)
        return self.tenant_for(tenant), priority

    def check_priority(self, priority: int) -> None:
        if self.min_priority is not None and priority < self.min_priority:
            raise NotAllowed(
                "priority",
                f"priority {priority} is more urgent than this token allows "
                f"(at least {self.min_priority})",
            )

    def scope(self, request_id: str) -> str:
        """The engine-wide id of this principal's request id."""
        return f"{self.name}/{request_id}"


def scoped(principal: Principal | None, request_id: str) -> str:
    """The engine-wide id of a request id: global without auth, else its principal's."""
    return request_id if principal is None else principal.scope(request_id)


class Principals:
    def __init__(self, by_token: dict[str, Principal]) -> None:
        if not by_token:
            raise ValueError("auth needs at least one token")
        if any(not token for token in by_token):
            raise ValueError("auth tokens must not be empty")
        self._entries = [(f"Bearer {t}".encode(), p) for t, p in by_token.items()]

    @classmethod
    def single(cls, token: str) -> Principals:
        return cls({token: Principal("default")})

    @classmethod
    def load(cls, path: str | Path) -> Principals:
        """Read a token file (see the module doc); ValueError naming what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"auth token file {path}: {exc}") from None
        entries = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f'auth token file {path}: expected {{"tokens": [...]}}')
        by_token: dict[str, Principal] = {}
        names: set[str] = set()
        for i, entry in enumerate(entries):
            where = f"auth token file {path}, tokens[{i}]"
            principal, token = _principal(entry, where)
            if token in by_token:
                raise ValueError(f"{where}: the same token is listed twice")
            if principal.name in names:
                raise ValueError(f"{where}: principal {principal.name!r} is listed twice")
            names.add(principal.name)
            by_token[token] = principal
        return cls(by_token)

    def tenants(self) -> list[str]:
        """Every tenant a token names (they get metric labels from the start)."""
        return [t for _, p in self._entries for t in p.tenants or ()]

    def lookup(self, authorization: str | bytes | None) -> Principal | None:
        """The principal of an ``authorization`` header value, or None."""
        if authorization is None:
            return None
        given = authorization.encode() if isinstance(authorization, str) else authorization
        found = None
        for expected, principal in self._entries:
            # Every entry, in constant time: timing must not reveal which token was close.
            if hmac.compare_digest(given, expected):
                found = principal
        return found

    def of_metadata(self, metadata: Iterable[tuple[str, Any]] | None) -> Principal | None:
        values = [v for k, v in metadata or () if k == "authorization"]
        return self.lookup(values[0]) if values else None


def _principal(entry: Any, where: str) -> tuple[Principal, str]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    token, name = entry.get("token"), entry.get("principal")
    if not isinstance(token, str) or not token:
        raise ValueError(f"{where}: token must be a non-empty string")
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{where}: principal must be a non-empty name without '/'")
    tenants = entry.get("tenants")
    if tenants is not None and (
        not isinstance(tenants, list) or not tenants or not all(isinstance(t, str) for t in tenants)
    ):
        raise ValueError(f"{where}: tenants must be a non-empty list of names")
    floor = entry.get("min_priority")
    if floor is not None and (not isinstance(floor, int) or isinstance(floor, bool)):
        raise ValueError(f"{where}: min_priority must be an integer")
    return Principal(name, tuple(tenants) if tenants else None, floor), token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, principals: Principals) -> None:
        self.principals = principals

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIX):
            return handler
        metadata = details.invocation_metadata or ()
        if not any(k == "authorization" for k, _ in metadata):
            return _rejecting(handler, "MISSING_TOKEN")
        if self.principals.of_metadata(metadata) is None:
            return _rejecting(handler, "BAD_TOKEN")
        return handler


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
