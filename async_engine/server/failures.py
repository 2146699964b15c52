"""The one table of why a Generate call fails -> its gRPC status: errors submitting a
request, and finish reasons that are no normal end (those are statuses, not Finished).

Apart from server.errors so that the codec (and the CLI's flags, built from its limits)
need not import the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from async_engine.core.engine import EngineClosedError
from async_engine.core.inputs import DuplicateRequestError, QueueFullError
from async_engine.core.request import FinishReason
from async_engine.server.errors import (
    RpcFailure,
    already_exists,
    internal,
    invalid_argument,
    resource_exhausted,
    unavailable,
)


@dataclass(slots=True)
class Refused:
    """What a refusal's status names: the request as its client knows it."""

    request_id: str
    prompt_field: str = "prompt"  # "text" | "token_ids" | "chat": where prompt errors point
    message: str = ""  # the engine's, for an error it raised


# Why a request did not run, or ended without a normal end -> its status. Errors come from
# submitting it; finish reasons from the engine (a normal end is a Finished message).
_STATUSES: dict[type[Exception] | FinishReason, Callable[[Refused], RpcFailure]] = {
    DuplicateRequestError: lambda r: already_exists(r.request_id),
    QueueFullError: lambda r: resource_exhausted(r.message, "QUEUE_FULL"),
    EngineClosedError: lambda r: unavailable(r.message, "ENGINE_STOPPED"),  # let routers go on
    ValueError: lambda r: invalid_argument(r.message, prompt_field=r.prompt_field),
    FinishReason.QUEUE_TIMEOUT: lambda r: resource_exhausted(
        "request was not admitted within max_queue_ms", "QUEUE_TIMEOUT"
    ),
    FinishReason.UNREAD: lambda r: resource_exhausted(
        "the stream was not read fast enough: its unread output outgrew the server's budget",
        "UNREAD_OUTPUT",
    ),
    FinishReason.DEVICE_LOST: lambda r: unavailable(
        "the device running this request was lost after output had been sent; the "
        "server is replacing it: retry the request",
        "DEVICE_LOST",
    ),
    FinishReason.ERROR: lambda r: internal(
        "the model step running this request failed", r.request_id
    ),
}


def refusal(exc: Exception, request_id: str, prompt_field: str = "prompt") -> Exception:
    """The status of an error submitting a request; ``exc`` itself if it has none (a bug)."""
    for kind in type(exc).__mro__:
        make = _STATUSES.get(kind)
        if make is not None:
            return make(Refused(request_id, prompt_field, str(exc)))
    return exc


def failure(reason: FinishReason | None, request_id: str) -> RpcFailure | None:
    """The status of a request that ended with ``reason``; None for a normal end."""
    make = _STATUSES.get(reason) if reason is not None else None
    return make(Refused(request_id)) if make is not None else None
