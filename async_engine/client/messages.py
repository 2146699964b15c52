"""Between Python values and the Generation service's messages: a GenerateRequest built from
keyword arguments, events read from responses, typed errors read from a failed RPC."""

from __future__ import annotations

from collections.abc import Sequence
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
    error_from_status,
)
from async_engine.v1 import generation_pb2 as pb
from async_engine.v1.fields import place

_DETAIL_TYPES: tuple[type[Message], ...] = (
    error_details_pb2.BadRequest,
    error_details_pb2.ErrorInfo,
    error_details_pb2.RetryInfo,
    error_details_pb2.ResourceInfo,
    error_details_pb2.RequestInfo,
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
    """A GenerateRequest from keyword arguments (sampling, stop and output fields by name).

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
    msg.output.skip_detokenize = not detokenize
    # Any field of sampling, stop or output, by its proto or engine name (async_engine.v1.fields).
    for name, value in sampling.items():
        if value is None:
            continue
        where = place(name)
        if where is None or not where.part:
            raise TypeError(f"unknown generation option {name!r}")
        part = getattr(msg, where.part)
        if where.field.is_repeated:
            getattr(part, where.field.name).extend([value] if isinstance(value, str) else value)
        else:
            setattr(part, where.field.name, value)
    if max_queue_ms is not None:
        msg.max_queue_ms = max_queue_ms
    if time_limit_ms is not None:
        msg.time_limit_ms = time_limit_ms
    if logprobs is not None:
        msg.output.logprobs = logprobs
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
        prompt = [
            (p.logprob, p.rank, list(zip(p.top.token_ids, p.top.logprobs, strict=True)))
            for p in c.prompt_logprobs
        ]
        return Chunk(
            msg.seq, c.index, c.offset, list(c.token_ids), c.text, list(c.logprobs), top, prompt
        )
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
