"""Clients for the async_engine.v1 Generation service: ``AsyncClient`` and ``Client``.

Both yield plain dataclasses (``Accepted``, ``Chunk``, ``Finished``) and raise a typed
``EngineError`` subclass carrying the google.rpc details the server attached.
Leaving a ``generate`` loop early cancels the RPC, which aborts the request server-side.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from async_engine.client.messages import build_request, to_event, translate
from async_engine.client.types import Event, Load, ModelInfo
from async_engine.v1 import generation_pb2 as pb
from async_engine.v1 import generation_pb2_grpc as pb_grpc


@dataclass(slots=True)
class _ChannelConfig:
    target: str
    token: str | None = None
    root_certificates: bytes | None = None  # PEM; given: the channel uses TLS
    options: list[tuple[str, Any]] = field(default_factory=list)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.root_certificates is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)


class AsyncClient:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        options: list[tuple[str, Any]] | None = None,
    ) -> None:
        self._cfg = cfg = _ChannelConfig(target, token, root_certificates, options or [])
        creds = cfg.credentials()
        self.channel = (
            grpc.aio.secure_channel(target, creds, cfg.options)
            if creds is not None
            else grpc.aio.insecure_channel(target, cfg.options)
        )
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> AsyncIterator[Event]:
        async for msg in self.generate_raw(build_request(prompt, **options), timeout=timeout):
            yield to_event(msg)

    async def generate_raw(
        self, request: pb.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(request, timeout=timeout, metadata=self._cfg.metadata())
        try:
            async for msg in call:
                yield msg
        except grpc.RpcError as err:
            raise translate(err) from None
        finally:
            call.cancel()  # no-op once the RPC ended; otherwise the server aborts the request

    async def abort(
        self, request_ids: Sequence[str], reason: str = ""
    ) -> tuple[list[str], list[str]]:
        try:
            out = await self.stub.Abort(
                pb.AbortRequest(request_ids=list(request_ids), reason=reason),
                metadata=self._cfg.metadata(),
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return list(out.aborted), list(out.unknown)

    async def model_info(self) -> ModelInfo:
        try:
            return ModelInfo.from_pb(
                await self.stub.GetModelInfo(
                    pb.GetModelInfoRequest(), metadata=self._cfg.metadata()
                )
            )
        except grpc.RpcError as err:
            raise translate(err) from None

    async def load(self) -> Load:
        try:
            return Load.from_pb(
                await self.stub.GetLoad(pb.GetLoadRequest(), metadata=self._cfg.metadata())
            )
        except grpc.RpcError as err:
            raise translate(err) from None

    async def serving(self, timeout: float = 5.0) -> bool:
        """The server's gRPC health: True while it reports SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as err:
            raise translate(err) from None
        return reply.status == health_pb2.HealthCheckResponse.SERVING


class Client:
    """Blocking twin of AsyncClient (scripts, notebooks)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        options: list[tuple[str, Any]] | None = None,
    ) -> None:
        self._cfg = cfg = _ChannelConfig(target, token, root_certificates, options or [])
        creds = cfg.credentials()
        self.channel = (
            grpc.secure_channel(target, creds, cfg.options)
            if creds is not None
            else grpc.insecure_channel(target, cfg.options)
        )
        self.stub = pb_grpc.GenerationStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> Iterator[Event]:
        call = self.stub.Generate(
            build_request(prompt, **options), timeout=timeout, metadata=self._cfg.metadata()
        )
        try:
            for msg in call:
                yield to_event(msg)
        except grpc.RpcError as err:
            raise translate(err) from None
        finally:
            call.cancel()

    def abort(self, request_ids: Sequence[str], reason: str = "") -> tuple[list[str], list[str]]:
        try:
            out = self.stub.Abort(
                pb.AbortRequest(request_ids=list(request_ids), reason=reason),
                metadata=self._cfg.metadata(),
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return list(out.aborted), list(out.unknown)

    def model_info(self) -> ModelInfo:
        try:
            return ModelInfo.from_pb(
                self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._cfg.metadata())
            )
        except grpc.RpcError as err:
            raise translate(err) from None

    def load(self) -> Load:
        try:
            return Load.from_pb(
                self.stub.GetLoad(pb.GetLoadRequest(), metadata=self._cfg.metadata())
            )
        except grpc.RpcError as err:
            raise translate(err) from None
