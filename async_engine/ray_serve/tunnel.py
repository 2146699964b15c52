"""An HTTP request carried over a Serve handle call, for the ingress layout: the ingress
sends it as a ``Forwarded`` (whose ``prompt`` the prefix-affinity router reads), the
replica runs it through its ASGI app (``tunnel``) and streams the response's messages
back, and the ingress replays them to its client (``replay``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from async_engine.ray_serve.asgi import App
from async_engine.ray_serve.coalesce import Message, Send

_DONE = {"type": "tunnel.done"}
MAX_KEY_CHARS = 4096  # the router matches prefixes: the start of a prompt is enough


@dataclass(slots=True)
class Forwarded:
    """What a replica needs of an HTTP request. ``prompt`` is the routing text only: Ray's
    PrefixCacheAffinityRouter looks for an argument with a ``prompt`` attribute."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str = field(default="")

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": self.query_string,
            "root_path": "",
            "headers": self.headers,
            "client": None,
            "server": None,
        }


async def tunnel(app: App, request: Forwarded) -> AsyncIterator[list[Message]]:
    """Run ``request`` through ``app``; yield its response's messages, every batch being
    what was ready at once. Closing the generator (the caller left) cancels the app."""
    queue: asyncio.Queue[Message] = asyncio.Queue()
    received = False

    async def receive() -> Message:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await asyncio.Event().wait()  # the client is there until this call is cancelled
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        queue.put_nowait(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        finally:
            queue.put_nowait(_DONE)

    task = asyncio.create_task(run())
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            done = batch[-1] is _DONE
            messages = batch[:-1] if done else batch
            if messages:
                yield messages
            if done:
                break
        await task  # the app's error, if any, reaches the caller
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def replay(batches: AsyncIterator[list[Message]], send: Send) -> None:
    """Send a tunnelled response's messages to the client."""
    async for batch in batches:
        for message in batch:
            await send(message)


def routing_key(path: str, body: bytes) -> str:
    """The text the router matches replicas by: a completion's prompt (token ids written
    out), a chat's contents joined, or the path for other requests. Never empty: the
    router divides by its length."""
    try:
        data = json.loads(body) if path.endswith("completions") and body else None
    except ValueError:
        data = None
    text = ""
    if isinstance(data, dict):
        if "messages" in data and isinstance(data["messages"], list):
            text = "".join(_content(m) for m in data["messages"])
        elif "prompt" in data:
            text = _prompt_text(data["prompt"])
    return (text or path)[:MAX_KEY_CHARS]


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(p if isinstance(p, str) else str(p) for p in prompt)
    return ""


def _content(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "".join(t for t in parts if isinstance(t, str))
    return ""
