"""`bench serve --backend openai`: the same load through any OpenAI-compatible server.

Requests go to ``/v1/completions`` as token-id prompts with ``stream: true`` (greedy,
``ignore_eos``), so this server, llama.cpp's ``llama-server`` and vLLM get the same work.
A small asyncio HTTP/1.1 client reads the server-sent events: every event with text is a
streamed message (its arrival times give TTFT and ITL), and the final usage, where the
server sends it, gives the token count.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from async_engine.bench.load import RequestRecord, RequestSpec


class HttpTarget:
    def __init__(self, url: str, token: str | None = None) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(
                f"--target must be http://HOST:PORT for the openai backend, got {url!r}"
            )
        self.host, self.port = parts.hostname, parts.port or 80
        self.token = token

    async def request(self, method: str, path: str, body: Any = None) -> AsyncIterator[bytes]:
        """The response body's pieces (chunked transfer decoded); raises on a non-2xx."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            data = b"" if body is None else json.dumps(body).encode()
            head = [
                f"{method} {path} HTTP/1.1",
                f"Host: {self.host}:{self.port}",
                "Connection: close",
                "Content-Type: application/json",
                f"Content-Length: {len(data)}",
            ]
            if self.token:
                head.append(f"Authorization: Bearer {self.token}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            chunked = headers.get("transfer-encoding", "").lower() == "chunked"
            if status >= 300:
                rest = await reader.read()
                raise RuntimeError(f"HTTP {status}: {rest[:200]!r}")
            if not chunked:
                length = headers.get("content-length")
                yield await (reader.readexactly(int(length)) if length else reader.read())
                return
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    return
                yield await reader.readexactly(size)
                await reader.readline()
        finally:
            writer.close()

    async def json(self, path: str) -> Any:
        return json.loads(b"".join([piece async for piece in self.request("GET", path)]))

    async def events(self, path: str, body: Any) -> AsyncIterator[dict[str, Any]]:
        buffer = b""
        async for piece in self.request("POST", path, body):
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.splitlines():
                    if line.startswith(b"data:"):
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            return
                        yield json.loads(payload)


def openai_sender(target: HttpTarget, model: str, on_tokens: Any) -> Any:
    async def send(spec: RequestSpec, rec: RequestRecord) -> None:
        body = {
            "model": model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        usage = None
        stream = target.events("/v1/completions", body)
        try:
            async for event in stream:
                if "error" in event:
                    raise RuntimeError(f"in-stream error: {event['error']}")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    if choice.get("text") and on_tokens(spec, rec, 1):
                        rec.cancelled = True
                        break
                if rec.cancelled:
                    break
        finally:
            await stream.aclose()
        rec.end = time.perf_counter()
        if usage is not None and not rec.cancelled:
            rec.tokens = int(usage.get("completion_tokens", rec.tokens))

    return send


async def served_model(target: HttpTarget) -> str:
    models = (await target.json("/v1/models")).get("data") or []
    if not models:
        raise RuntimeError("the server lists no model at /v1/models")
    return str(models[0]["id"])
