"""Fewer, fuller messages through Ray: a streamed response is read only as fast as Ray can
afford to carry it, so the tokens made meanwhile ride one message.

Every body message of a streamed response costs Ray the same (a pickle, an object reported
to the proxy, a wake-up of the proxy's loop) whether it carries one token or ten. Sent one
token at a time, with every replica's streams at once, those costs cap throughput. The
engine already merges the output a reader has not taken yet into one delta (its
``RequestStream``), so nothing needs joining here: ``PacedSend`` only makes the reader take
less often. After a body message goes out, the ASGI ``send`` returns once the stream's
interval has passed; the response's loop then pulls the next event, which holds every
token made in the meantime, as one server-sent event.

The interval comes from a message budget per replica: with ``streams`` streams producing
tokens, each may send every ``streams / messages_per_s`` seconds. A lone stream is not held at all;
many streams are held just enough that their messages together stay within the budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

# A replica's messages per second through Ray. Measured on 2 sim replicas sharing 2 cores
# with Ray's proxy (512 streams at once): 2000 kept 0.88 of direct throughput, 4000 only 0.70
# (the proxy fell behind and every stream waited on it). A faster proxy core takes more.
DEFAULT_MESSAGES_PER_S = 2000.0
Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


@dataclass(slots=True)
class Pace:
    """How long a stream waits between two messages, given how many streams are open."""

    messages_per_s: float | None = DEFAULT_MESSAGES_PER_S  # the replica's; None: never wait
    max_interval_s: float = 0.05  # a stream never waits longer, however many are open

    def interval_s(self, streams: int) -> float:
        if not self.messages_per_s or streams <= 1:
            return 0.0
        return min(self.max_interval_s, streams / self.messages_per_s)


@dataclass(slots=True)
class StreamCounts:
    """What the paced streams of one replica sent: messages, the server-sent events in
    them, the streams producing now, and the responses cut short (cancelled before their
    end, the last at ``last_cut_short_at``, wall-clock time: when its requests were
    aborted)."""

    messages: int = 0
    events: int = 0
    active_streams: int = 0
    cut_short: int = 0
    last_cut_short_at: float = 0.0

    def events_per_message(self) -> float:
        return self.events / self.messages if self.messages else 0.0


class PacedSend:
    """An ASGI ``send`` for one response: a server-sent-event body is paced (see the module
    docstring); anything else passes straight through. ``close`` must follow the response,
    however it ended, so that the stream stops counting as active."""

    def __init__(self, send: Send, pace: Pace, counts: StreamCounts) -> None:
        self._send = send
        self._pace = pace
        self._counts = counts
        self._streaming = False  # a server-sent-event response
        self._active = False  # counted in counts.active_streams
        self._sent = 0
        self.request_id: str | None = None  # the response's x-request-id, once started
        self.ended = False  # the last body message went out

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = message.get("headers") or ()
            self.request_id = _header(headers, b"x-request-id")
            content_type = _header(headers, b"content-type") or ""
            self._streaming = content_type.split(";")[0].strip().lower() == "text/event-stream"
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        if kind != "http.response.body" or not self._streaming:
            await self._send(message)
            return
        body = message.get("body", b"")
        if body:
            self._count(body)
        if self.ended:
            self.close()
        await self._send(message)
        # The first message goes out at once and is not waited after: a chat's first
        # event is its role, and its first token should not wait for an interval.
        if self._active:
            interval = self._pace.interval_s(self._counts.active_streams)
            if interval > 0:
                await asyncio.sleep(interval)

    def _count(self, body: bytes) -> None:
        counts = self._counts
        self._sent += 1
        counts.messages += 1
        counts.events += body.count(b"\n\n")
        # From its second message a stream is producing tokens; before, it may wait in
        # the engine's queue, and a queue must not stretch the running streams' interval.
        if self._sent == 2 and not self.ended:
            self._active = True
            counts.active_streams += 1

    def close(self) -> None:
        if self._active:
            self._active = False
            self._counts.active_streams -= 1


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if bytes(key).lower() == name:
            return bytes(value).decode("latin-1")
    return None
