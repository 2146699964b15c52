"""The ingress deployment of the prefix-affinity layout: it reads each HTTP request, names
its prompt for the router and forwards it to a replica through a handle.

Ray's ``PrefixCacheAffinityRouter`` chooses a replica from the text of the call's
arguments; the proxy's call to a replica carries only the raw ASGI request, so with that
router the request must be read first. This hop costs a second Ray message per message
(ingress to proxy as well as replica to ingress), which is why it is not the default.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ray import serve

from async_engine.ray_serve.asgi import Receive, lifespan
from async_engine.ray_serve.coalesce import Send
from async_engine.ray_serve.tunnel import Forwarded, replay, routing_key


@serve.ingress()
class EngineIngress:
    def __init__(self, replica: Any, max_body_bytes: int = 4 << 20) -> None:
        self.replica = replica.options(stream=True)
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self) -> IngressApp:
        return IngressApp(self.replica, self.max_body_bytes)


class IngressApp:
    """The ingress's ASGI app (an object: uvicorn takes a bound method for ASGI 2)."""

    def __init__(self, replica: Any, max_body_bytes: int) -> None:
        self.replica = replica
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        body = await _read_body(receive, self.max_body_bytes)
        if body is None:
            await _refuse(send, 413, f"request body over {self.max_body_bytes} bytes")
            return
        request = Forwarded(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=list(scope.get("headers") or []),
            body=body,
            prompt=routing_key(scope["path"], body),
        )
        responses = self.replica.forward.remote(request)
        relay = asyncio.create_task(replay(responses, send))
        left = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait((relay, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The client left (seen here, or Serve cancelled this call): cancelling the
            # relay task does not reach the replica; cancelling its call does.
            if not relay.done():
                responses.cancel()
            for task in (relay, left):
                task.cancel()
            await asyncio.gather(relay, left, return_exceptions=True)
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()  # type: ignore[misc]


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _refuse(send: Send, status: int, text: str) -> None:
    body = json.dumps({"error": {"message": text, "type": "invalid_request_error"}}).encode()
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
