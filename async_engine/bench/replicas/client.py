"""Streamed completions over plain HTTP/1.1, one connection per request (closing it is how
a client cancels), and the load that sends the workload's prompts through them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from async_engine.bench.load import RequestRecord
from async_engine.bench.replicas.workload import Prompt, Workload

GROUP_HEADER = "x-bench-group"  # read by the taps in front of the replicas
SESSION_HEADER = "x-session-id"  # a conversation's id, as routers with session affinity read it


async def sse_events(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent-event response; leaving the loop closes the
    connection at once (the generator's ``aclose``), which cancels the request."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
        head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "transfer-encoding":
                chunked = "chunked" in value.lower()
        if status >= 300:
            raise RuntimeError(f"HTTP {status}: {(await reader.read(300))!r}")
        buffer = b""
        async for piece in _body(reader, chunked):
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.splitlines():
                    payload = line[5:].strip() if line.startswith(b"data:") else b""
                    if payload == b"[DONE]":
                        return
                    if payload:
                        yield json.loads(payload)
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while size := int((await reader.readline()).split(b";")[0], 16):
        yield await reader.readexactly(size)
        await reader.readline()


@dataclass(slots=True)
class Sample:
    group: int
    target: int  # index into the phase's URLs
    record: RequestRecord = field(default_factory=RequestRecord)
    cached_tokens: int = 0  # the server's usage.prompt_tokens_details.cached_tokens


def completion_body(model: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send(
    url: str, model: str, prompt: Prompt, max_tokens: int, request_id: str, session: bool = False
) -> Sample:
    sample = Sample(prompt.group, 0)
    rec = sample.record
    headers = {GROUP_HEADER: f"g{prompt.group}", "x-request-id": request_id}
    if session:
        headers[SESSION_HEADER] = f"g{prompt.group}"
    rec.sent = time.perf_counter()
    try:
        body = completion_body(model, prompt.tokens, max_tokens)
        async for event in sse_events(url, "/v1/completions", body, headers):
            now = time.perf_counter()
            if any(choice.get("text") for choice in event.get("choices") or []):
                rec.first_token = rec.first_token or now
                rec.chunk_times.append(now)
            if usage := event.get("usage"):
                rec.tokens = int(usage.get("completion_tokens", 0))
                details = usage.get("prompt_tokens_details") or {}
                sample.cached_tokens = int(details.get("cached_tokens") or 0)
    except Exception as exc:  # the request's failure, counted in the report; the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    rec.end = time.perf_counter()
    return sample


async def run_load(
    urls: list[str], model: str, prompts: list[Prompt], workload: Workload, run_id: str
) -> tuple[list[Sample], float]:
    """Every prompt, in order, by ``workload.concurrency`` workers (worker k starting
    ``k * workload.ramp_ms`` in); the i-th request goes to ``urls[i % len(urls)]`` (one URL:
    a router or one replica; several: round robin)."""
    queue: asyncio.Queue[tuple[int, Prompt]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    samples: list[Sample] = []

    async def worker(k: int) -> None:
        await asyncio.sleep(k * workload.ramp_ms / 1000)
        while not queue.empty():
            i, prompt = queue.get_nowait()
            target = i % len(urls)
            rid = f"{run_id}-{i}"
            sample = await send(
                urls[target], model, prompt, workload.output_tokens, rid, workload.sessions
            )
            sample.target = target
            samples.append(sample)

    start = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(workload.concurrency)))
    return samples, time.perf_counter() - start
