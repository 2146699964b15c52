"""The Generation service: one Generate RPC per request, so a dropped stream is an abort.

Stream rules (what every client may rely on): ``Accepted`` first (seq 0), sent once the
request was admitted (its prefix-cache hit is then known); ``Chunk``s with contiguous
offsets per index; exactly one ``Finished`` per index whose usage counts what was
streamed; then status OK. Failures are statuses only (see server.failures).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog

from async_engine.core.group import RequestGroup
from async_engine.core.output import RequestDelta
from async_engine.server.auth import NotAllowed, Principal, scoped
from async_engine.server.codec import accepted as accepted_msg
from async_engine.server.codec import chunk as chunk_msg
from async_engine.server.codec import decode_request
from async_engine.server.codec import finished as finished_msg
from async_engine.server.errors import (
    RpcFailure,
    already_exists,
    internal,
    invalid_argument,
    permission_denied,
    unavailable,
)
from async_engine.server.failures import failure, refusal
from async_engine.server.state import ServingState
from async_engine.v1 import generation_pb2 as pb
from async_engine.v1 import generation_pb2_grpc as pb_grpc

log = structlog.get_logger("async_engine.server.service")
TENANT_METADATA = "x-tenant"


@dataclass(slots=True)
class _Call:
    """A Generate RPC in flight: its engine requests, one per output index."""

    request_id: str  # as the client knows it
    scoped_id: str  # engine-wide: the request id within its principal's scope
    group: RequestGroup


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, state: ServingState) -> None:
        self.state = state
        self.engine = state.engine
        self.calls: dict[str, _Call] = {}
        self.idle = asyncio.Event()  # set while no Generate call is in flight
        self.idle.set()

    # ---------------------------------------------------------------- Generate
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            call = await self._admit(request, self._principal(context), _tenant_header(context))
        except RpcFailure as exc:
            await context.abort_with_status(exc.to_status())
            return
        bound = log.bind(request_id=call.request_id, tenant=call.group.children[0].tenant)
        bound.debug("request.accepted", n=len(call.group))
        ended: RpcFailure | None = None
        try:
            async for msg in self._responses(call):
                with self.state.stalls.write():
                    yield msg
        except RpcFailure as exc:
            ended = exc
        except Exception as exc:  # a bug of ours: report it as INTERNAL, not UNKNOWN
            bound.exception("request.crashed")
            ended = internal(f"server error: {exc!r}", call.request_id)
        finally:
            self._end(call, bound)
        if ended is not None:
            await context.abort_with_status(ended.to_status())

    def _principal(self, context: grpc.aio.ServicerContext) -> Principal | None:
        if self.state.principals is None:
            return None
        # The interceptor let only known tokens through.
        return self.state.principals.of_metadata(context.invocation_metadata())

    async def _admit(
        self, request: pb.GenerateRequest, principal: Principal | None, tenant_header: str = ""
    ) -> _Call:
        if self.state.draining:
            raise unavailable("server is draining; retry on another replica")
        limits = self.state.limits
        sub = decode_request(request, limits)
        options = sub.options
        if not options.tenant and tenant_header:
            if len(tenant_header) > limits.max_tenant_chars:
                raise invalid_argument(
                    f"x-tenant is longer than {limits.max_tenant_chars} characters", "x-tenant"
                )
            options.tenant = tenant_header
        if principal is not None:
            try:
                options.tenant, options.priority = principal.admit(options.tenant, options.priority)
            except NotAllowed as exc:
                raise permission_denied(str(exc), exc.field) from None
        rid = sub.request_id or uuid.uuid4().hex
        try:
            sub.prompt = await self.engine.prepare(sub.prompt, sub.params, options.messages)
            options.messages = None  # templated off the loop: the prompt holds its ids now
        except ValueError as exc:
            raise refusal(exc, rid, sub.prompt_field) from None
        scoped_id = scoped(principal, rid)
        if scoped_id in self.calls:
            raise already_exists(rid)
        try:
            samples = self.state.submit(sub.prompt, sub.params, scoped_id, options)
        except Exception as exc:
            raise refusal(exc, rid, sub.prompt_field) from None
        call = self.calls[scoped_id] = _Call(rid, scoped_id, samples)
        self.idle.clear()
        return call

    async def _responses(self, call: _Call) -> AsyncIterator[pb.GenerateResponse]:
        seq = 0
        emitted = [0] * len(call.group)
        async for index, delta in call.group.deltas():
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
        call.group.release()  # aborts what still runs; its metrics are recorded there
        for req in call.group.children:
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
                call.group.abort()
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
        stats = self.engine.stats()  # HTTP /get_load: running + waiting of the same stats
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
                for t, w, r in self.engine.tenant_depths()
            ],
        )


def _tenant_header(context: grpc.aio.ServicerContext) -> str:
    """The ``x-tenant`` metadata entry: the tenant of a request whose field is empty."""
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_METADATA:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def _raise_if_failed(call: _Call, delta: RequestDelta) -> None:
    failed = failure(delta.finish_reason, call.request_id)
    if failed is not None:
        raise failed
