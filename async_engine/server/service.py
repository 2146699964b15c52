"""The Generation service: one Generate RPC per request, so a dropped stream is an abort.

Stream rules (what every client may rely on): ``Accepted`` first (seq 0), sent once the
request was admitted (its prefix-cache hit is then known); ``Chunk``s with contiguous
offsets per index; exactly one ``Finished`` per index whose usage counts what was
streamed; then status OK. Failures are statuses only (see server_errors).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from async_engine.core.engine import AsyncEngine, EngineClosedError
from async_engine.core.fanout import child_ids
from async_engine.core.inputs import DuplicateRequestError, QueueFullError
from async_engine.core.output import RequestDelta
from async_engine.core.request import FinishReason, Request
from async_engine.server.auth import NotAllowed, Principal, Principals, scoped
from async_engine.server.codec import Limits, Submission, decode_request
from async_engine.server.codec import accepted as accepted_msg
from async_engine.server.codec import chunk as chunk_msg
from async_engine.server.codec import finished as finished_msg
from async_engine.server.errors import (
    RpcFailure,
    already_exists,
    internal,
    invalid_argument,
    permission_denied,
    resource_exhausted,
    unavailable,
)
from async_engine.server.metrics import ServerMetrics
from async_engine.server.stalls import StalledStreams
from async_engine.v1 import generation_pb2 as pb
from async_engine.v1 import generation_pb2_grpc as pb_grpc

log = structlog.get_logger("async_engine.server.service")
TENANT_METADATA = "x-tenant"


@dataclass(slots=True)
class _Call:
    """A Generate RPC in flight: its engine requests, one per output index."""

    request_id: str  # as the client knows it
    scoped_id: str  # engine-wide: the request id within its principal's scope
    children: list[Request] = field(default_factory=list)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        limits: Limits | None = None,
        stalls: StalledStreams | None = None,
        principals: Principals | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.limits = limits or Limits()
        self.stalls = stalls or StalledStreams(60.0)
        self.principals = principals  # None: no auth, ids are global
        self.draining = False
        self.calls: dict[str, _Call] = {}
        self.idle = asyncio.Event()  # set while no Generate call is in flight
        self.idle.set()

    # ---------------------------------------------------------------- Generate
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            call = await self._admit(request, self._principal(context), _tenant_header(context))
        except RpcFailure as failure:
            await context.abort_with_status(failure.to_status())
            return
        bound = log.bind(request_id=call.request_id, tenant=call.children[0].tenant)
        bound.debug("request.accepted", n=len(call.children))
        failure: RpcFailure | None = None
        try:
            async for msg in self._responses(call):
                with self.stalls.write():
                    yield msg
        except RpcFailure as exc:
            failure = exc
        except Exception as exc:  # a bug of ours: report it as INTERNAL, not UNKNOWN
            bound.exception("request.crashed")
            failure = internal(f"server error: {exc!r}", call.request_id)
        finally:
            self._end(call, bound)
        if failure is not None:
            await context.abort_with_status(failure.to_status())

    def _principal(self, context: grpc.aio.ServicerContext) -> Principal | None:
        if self.principals is None:
            return None
        # The interceptor let only known tokens through.
        return self.principals.of_metadata(context.invocation_metadata())

    async def _admit(
        self, request: pb.GenerateRequest, principal: Principal | None, tenant_header: str = ""
    ) -> _Call:
        if self.draining:
            raise unavailable("server is draining; retry on another replica")
        sub = decode_request(request, self.limits)
        if not sub.tenant and tenant_header:
            if len(tenant_header) > self.limits.max_tenant_chars:
                raise invalid_argument(f"x-tenant is longer than {self.limits.max_tenant_chars} "
                                       "characters", "x-tenant")  # fmt: skip
            sub.tenant = tenant_header
        if principal is not None:
            try:
                sub.tenant, sub.priority = principal.admit(sub.tenant, sub.priority)
            except NotAllowed as exc:
                raise permission_denied(str(exc), exc.field) from None
        try:
            sub.prompt = await self.engine.prepare(sub.prompt, sub.params, sub.messages)
            sub.messages = None  # templated off the loop: the prompt holds its ids now
        except ValueError as exc:
            raise invalid_argument(str(exc), prompt_field=sub.prompt_field) from None
        rid = sub.request_id or uuid.uuid4().hex
        scoped_id = scoped(principal, rid)
        if scoped_id in self.calls:
            raise already_exists(rid)
        call = _Call(rid, scoped_id)
        try:
            for i, child_id in enumerate(child_ids(scoped_id, sub.n)):
                call.children.append(self._add(sub, child_id, i))
        except BaseException:
            for req in call.children:
                self.engine.release(req)
            raise
        self.calls[scoped_id] = call
        self.idle.clear()
        return call

    def _add(self, sub: Submission, child_id: str, index: int) -> Request:
        try:
            return self.engine.add_request(
                sub.prompt, sub.params_for(index), child_id, **sub.options()
            )
        except DuplicateRequestError:  # a child id another call of this scope holds
            raise already_exists(sub.request_id or child_id) from None
        except QueueFullError as exc:
            raise resource_exhausted(str(exc), "QUEUE_FULL") from None
        except ValueError as exc:
            raise invalid_argument(str(exc), prompt_field=sub.prompt_field) from None
        except EngineClosedError as exc:  # the device died: let routers go elsewhere
            raise unavailable(str(exc), "ENGINE_STOPPED") from None

    async def _responses(self, call: _Call) -> AsyncIterator[pb.GenerateResponse]:
        seq = 0
        emitted = [0] * len(call.children)
        async for index, delta in merge_streams(self.engine, call.children):
            if seq == 0:
                _raise_if_failed(call, delta)
                yield accepted_msg(
                    0, call.request_id, delta.num_prompt_tokens, delta.num_cached_tokens
                )
                seq = 1
            if delta.token_ids or delta.text:
                if delta.offset != emitted[index]:  # an engine bug; never send a gap
                    raise internal(
                        f"output offset {delta.offset} != {emitted[index]}", call.request_id
                    )
                yield chunk_msg(seq, index, delta)
                seq += 1
                emitted[index] += len(delta.token_ids)
            if delta.finished:
                _raise_if_failed(call, delta)
                yield finished_msg(seq, index, delta, emitted[index])
                seq += 1

    def _end(self, call: _Call, bound: structlog.typing.FilteringBoundLogger) -> None:
        for req in call.children:
            self.engine.release(req)  # aborts what still runs: the client is gone
            self.metrics.on_request_end(req)
            reason = req.finish_reason.value if req.finish_reason else None
            bound.info(
                "request.finished",
                child=req.request_id,
                reason=reason,
                prompt_tokens=req.num_prompt_tokens,
                completion_tokens=len(req.output_ids),
                cached_tokens=req.num_cached_tokens,
            )
        self.calls.pop(call.scoped_id, None)
        if not self.calls:
            self.idle.set()

    # ------------------------------------------------------------ unary RPCs
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        aborted, unknown = [], []
        principal = self._principal(context)
        for rid in request.request_ids:
            scoped_id = scoped(principal, rid)
            call = self.calls.get(scoped_id)
            if call is not None:
                for req in call.children:
                    self.engine.finish(req.request_id)
                aborted.append(rid)
            elif self.engine.finish(scoped_id):  # one child of an n > 1 call (core.fanout)
                aborted.append(rid)
            else:
                unknown.append(rid)
        if aborted:
            log.info("abort", request_ids=aborted, reason=request.reason)
        return pb.AbortResponse(aborted=aborted, unknown=unknown)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        engine = self.engine
        return pb.ModelInfo(
            model=str(engine.config.model),
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            eos_token_ids=list(engine.model_config.eos_token_ids),
            dtype=str(engine.dtype),
            device=str(engine.device_kind),
        )

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.Load:
        stats = self.engine.stats()
        return pb.Load(
            running=stats.running,
            waiting=stats.waiting,
            kv_usage=stats.kv_usage,
            free_blocks=self.engine.pool.num_free,  # evictable prefix-cache blocks count as free
            total_blocks=stats.kv_blocks_total,
            device_state=stats.device_state,
            device_restarts=stats.device_restarts,
            tenants=[
                pb.TenantLoad(tenant=t, waiting=w, running=r)
                for t, w, r in self.engine.scheduler.tenant_depths()
            ],  # fmt: skip
        )


def _tenant_header(context: grpc.aio.ServicerContext) -> str:
    """The ``x-tenant`` metadata entry: the tenant of a request whose field is empty."""
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_METADATA:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def _raise_if_failed(call: _Call, delta: RequestDelta) -> None:
    if delta.finish_reason is FinishReason.QUEUE_TIMEOUT:
        raise resource_exhausted("request was not admitted within max_queue_ms", "QUEUE_TIMEOUT")
    if delta.finish_reason is FinishReason.UNREAD:
        raise resource_exhausted(
            "the stream was not read fast enough: its unread output outgrew the server's budget",
            "UNREAD_OUTPUT",
        )
    if delta.finish_reason is FinishReason.DEVICE_LOST:
        raise unavailable(
            "the device running this request was lost after output had been sent; the "
            "server is replacing it: retry the request",
            "DEVICE_LOST",
        )
    if delta.finish_reason is FinishReason.ERROR:
        raise internal("the model step running this request failed", call.request_id)


async def merge_streams(
    engine: AsyncEngine, children: list[Request]
) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(index, delta) from every child, as they come. Pulls only when the caller asks, so
    each child's stream keeps coalescing for a slow reader instead of queueing here."""
    if len(children) == 1:
        async for delta in engine.stream(children[0]):
            yield 0, delta
        return
    streams = [engine.stream(req) for req in children]
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                delta = future.result()
                yield index, delta
                if not delta.finished:
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for future in pending:
            future.cancel()
