"""The ASGI app a replica hands to Serve: the project's OpenAI app, its streamed responses
paced (``coalesce``), and a lifespan whose shutdown drains the replica.

Serve runs the app's lifespan shutdown when it stops a replica, after its own graceful
drain (``graceful_shutdown_timeout_s``), so that is where the engine is closed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from async_engine.ray_serve.coalesce import Message, Pace, PacedSend, Send, StreamCounts

Receive = Callable[[], Awaitable[Message]]
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


class ReplicaAsgi:
    """``on_abandoned(request_id)`` is called when a response is cancelled before its end
    (Serve cancels the call of a client that left): the handler's own cleanup aborts the
    request too, but a stream cancelled while its events wait to be sent is only closed
    when it is collected, so the abort should not wait for that."""

    def __init__(
        self,
        app: App,
        pace: Pace,
        counts: StreamCounts,
        on_shutdown: Callable[[], Awaitable[None]],
        on_abandoned: Callable[[str], None],
    ) -> None:
        self.app = app
        self.pace = pace
        self.counts = counts
        self._on_shutdown = on_shutdown
        self._on_abandoned = on_abandoned

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self._on_shutdown)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        paced = PacedSend(send, self.pace, self.counts)
        try:
            await self.app(scope, receive, paced)
        finally:
            paced.close()
            if not paced.ended:
                self._cut_short(paced.request_id)

    def _cut_short(self, request_id: str | None) -> None:
        if request_id is not None:
            self._on_abandoned(request_id)
        self.counts.cut_short += 1
        self.counts.last_cut_short_at = time.time()


async def lifespan(
    receive: Receive, send: Send, on_shutdown: Callable[[], Awaitable[None]] | None = None
) -> None:
    """The ASGI lifespan protocol: nothing to start; ``on_shutdown`` at shutdown."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            try:
                if on_shutdown is not None:
                    await on_shutdown()
            except Exception as exc:  # reported to the server, which logs it
                await send({"type": "lifespan.shutdown.failed", "message": repr(exc)})
                return
            await send({"type": "lifespan.shutdown.complete"})
            return
