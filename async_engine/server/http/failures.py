"""The one table of why an OpenAI request fails -> its HTTP error: errors submitting it,
and finish reasons that are no normal end.

Apart from http.errors so that the request parsing need not import the engine.
"""

from __future__ import annotations

from collections.abc import Callable

from async_engine.core.engine import EngineClosedError
from async_engine.core.inputs import DuplicateRequestError, QueueFullError
from async_engine.core.request import FinishReason
from async_engine.server.http.errors import HttpError, bad_request

# Why a request did not run, or ended without a normal end -> its HTTP error. Errors come
# from submitting it (their text is the message); finish reasons from the engine.
_ERRORS: dict[type[Exception] | FinishReason, Callable[[str], HttpError]] = {
    DuplicateRequestError: lambda text: HttpError(
        400, text, "x-request-id", "duplicate_request_id"
    ),
    QueueFullError: lambda text: HttpError(429, text, None, "queue_full"),
    EngineClosedError: lambda text: HttpError(503, text, None, "engine_stopped"),
    ValueError: bad_request,
    FinishReason.DEVICE_LOST: lambda _: HttpError(
        503, "the device running this request was lost; retry it", None, "device_lost"
    ),
    FinishReason.ERROR: lambda _: HttpError(500, "the model step running this request failed"),
    FinishReason.QUEUE_TIMEOUT: lambda _: HttpError(
        429, "request was not admitted in time", None, "queue_timeout"
    ),
    FinishReason.UNREAD: lambda _: HttpError(
        429, "the stream was not read fast enough", None, "unread_output"
    ),
}


def refusal(exc: Exception) -> Exception:
    """The HTTP error of an error submitting a request; ``exc`` itself if it has none."""
    if isinstance(exc, HttpError):
        return exc
    for kind in type(exc).__mro__:
        make = _ERRORS.get(kind)
        if make is not None:
            return make(str(exc))
    return exc


def failure(reason: FinishReason | None) -> HttpError | None:
    """The HTTP error of a request that ended with ``reason``; None for a normal end."""
    make = _ERRORS.get(reason) if reason is not None else None
    return make("") if make is not None else None
