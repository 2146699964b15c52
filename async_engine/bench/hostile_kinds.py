"""The hostile requests of `bench soak --hostile`, by name: each sends one over gRPC or HTTP
(huge prompts and chats, maximal stop lists, deep bodies, grammar bombs)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

Hostile = Callable[[], Awaitable[Any]]
STOPS = [f"{i:03d}" + "s" * 60 for i in range(64)]  # the maximum: 64 strings, 4 KiB


async def http_post(port: int, path: str, body: bytes) -> int:
    """POST ``body`` as JSON; the response's status code (0: the server hung up)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        line = await reader.readline()
        return int(line.split()[1]) if line.startswith(b"HTTP/") else 0
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def grpc_kinds(client: Any) -> dict[str, Hostile]:
    async def drain(**request: Any) -> None:
        async for _ in client.generate(**request):
            pass

    thousand = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "w" * 1000} for i in range(1000)
    ]
    templated = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 240}
        for i in range(500)
    ]
    return {
        "4 MB prompts": lambda: drain(prompt="x" * (4 << 20), max_tokens=1),
        "100k-char prompts": lambda: drain(prompt="word " * 20_000, max_tokens=1),
        "64 stop strings x 256 tokens": lambda: drain(
            prompt=[5, 6, 7], max_tokens=256, stop=STOPS, ignore_eos=True
        ),
        "the same 256 tokens, no stop strings": lambda: drain(
            prompt=[5, 6, 7], max_tokens=256, ignore_eos=True
        ),
        "1 MiB chats": lambda: drain(
            messages=[{"role": "user", "content": "x" * (1 << 20)}], max_tokens=1
        ),
        "1,000-message chats": lambda: drain(messages=thousand, max_tokens=1),
        "0.6 M-char chats, templated": lambda: drain(messages=templated, max_tokens=1),
        "grammar bombs (regex)": lambda: drain(
            prompt=[5], max_tokens=1, structured_output=("regex", "(a|aa)*" * 2000)
        ),
    }


def http_kinds(port: int) -> dict[str, Hostile]:
    def chat(content: str, **extra: Any) -> bytes:
        return json.dumps(
            {
                "model": "default",
                "max_tokens": 1,
                **extra,
                "messages": [{"role": "user", "content": content}],
            }
        ).encode()

    def tools() -> list[dict]:  # 128 functions with schemas never seen before: no cache helps
        salt = os.urandom(4).hex()
        return [
            {
                "type": "function",
                "function": {
                    "name": f"f{i}",
                    "parameters": {
                        "type": "object",
                        "properties": {f"p{salt}": {"type": "string"}},
                    },
                },
            }
            for i in range(128)
        ]

    deep = b'{"model": "default", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    enum = {
        "type": "json_schema",
        "json_schema": {"name": "e", "schema": {"enum": [f"v{i}" for i in range(100_000)]}},
    }
    return {
        "HTTP 4 MB chats": lambda: http_post(port, "/v1/chat/completions", chat("x" * (4 << 20))),
        "HTTP chats with 128 new tools, auto": lambda: http_post(
            port, "/v1/chat/completions", chat("hi " * 5000, tools=tools())
        ),
        "HTTP bodies nested 100k deep": lambda: http_post(port, "/v1/completions", deep),
        "HTTP grammar bombs (a 100k enum)": lambda: http_post(
            port, "/v1/chat/completions", chat("a", response_format=enum)
        ),
    }
