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
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

from async_engine.client.types import (
    Accepted,
    Chunk,
    EngineError,
    Event,
    Finished,
    Load,
    ModelInfo,
    error_from_status,
)
from async_engine.v1 import generation_pb2 as pb
from async_engine.v1 import generation_pb2_grpc as pb_grpc

_DETAIL_TYPES: tuple[type[Message], ...] = (
    error_details_pb2.BadRequest,
    error_details_pb2.ErrorInfo,
    error_details_pb2.RetryInfo,
    error_details_pb2.ResourceInfo,
    error_details_pb2.RequestInfo,
)
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "n",
)
_STOP_FIELDS = (
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str",
)


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    request_id: str = "",
    priority: int = 0,
    tenant: str = "",
    max_queue_ms: int | None = None,
    time_limit_ms: int | None = None,
    logprobs: int | None = None,
    detokenize: bool = True,
    structured_output: tuple[str, str] | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments (sampling and stop fields by name).

    ``structured_output``: ("json", ""), ("json_schema", schema_json), ("regex", pattern) or
    ("grammar", ebnf)."""
    msg = pb.GenerateRequest(request_id=request_id, priority=priority, tenant=tenant)
    if messages is not None:
        msg.chat.messages.extend(
            pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
    elif isinstance(prompt, str):
        msg.text = prompt
    elif prompt is not None:
        msg.token_ids.ids.extend(prompt)
    for name, value in sampling.items():
        if value is None:
            continue
        if name in _SAMPLING_FIELDS:
            setattr(msg.sampling, name, value)
        elif name in ("stop", "stop_token_ids"):
            getattr(msg.stop, name).extend([value] if isinstance(value, str) else value)
        elif name in _STOP_FIELDS:
            setattr(msg.stop, name, value)
        else:
            raise TypeError(f"unknown generation option {name!r}")
    if max_queue_ms is not None:
        msg.max_queue_ms = max_queue_ms
    if time_limit_ms is not None:
        msg.time_limit_ms = time_limit_ms
    if logprobs is not None:
        msg.output.logprobs = logprobs
    msg.output.skip_detokenize = not detokenize
    if structured_output is not None:
        kind, spec = structured_output
        if kind == "json":
            msg.structured_output.json = True
        else:
            setattr(msg.structured_output, kind, spec)
    return msg


def to_event(msg: pb.GenerateResponse) -> Event:
    kind = msg.WhichOneof("kind")
    if kind == "accepted":
        a = msg.accepted
        return Accepted(msg.seq, a.request_id, a.prompt_tokens, a.cached_tokens)
    if kind == "chunk":
        c = msg.chunk
        top = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in c.top_logprobs]
        return Chunk(msg.seq, c.index, c.offset, list(c.token_ids), c.text, list(c.logprobs), top)
    f = msg.finished
    matched = f.WhichOneof("matched")
    return Finished(
        msg.seq,
        f.index,
        pb.FinishReason.Name(f.reason).removeprefix("FINISH_REASON_").lower(),
        f.stop_token_id if matched == "stop_token_id" else None,
        f.stop_str if matched == "stop_str" else None,
        f.usage.prompt_tokens,
        f.usage.completion_tokens,
        f.usage.cached_tokens,
        f.timings.queue_s,
        f.timings.ttft_s,
        f.timings.e2e_s,
    )


def translate(err: grpc.RpcError) -> EngineError:
    """A grpc error (sync or aio) -> the typed EngineError with its google.rpc details."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = err.details() if hasattr(err, "details") else str(err)
    details: list[Message] = []
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            message = status.message or message
            for packed in status.details:
                for cls in _DETAIL_TYPES:
                    if packed.Is(cls.DESCRIPTOR):
                        detail = cls()
                        packed.Unpack(detail)
                        details.append(detail)
    return error_from_status(code, message or "", details)


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
