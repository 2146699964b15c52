"""The Ray Serve replica's parts that need no Ray: paced streams (tokens coalesced per
message), the abort of a response cut short, the shutdown drain, the ingress tunnel and
routing key, and serve-ray's message when Ray is missing. A sim engine serves in process;
its app is called as ASGI directly."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from async_engine.ray_serve.coalesce import Pace, PacedSend, StreamCounts
from async_engine.ray_serve.serving import ReplicaOptions, ReplicaServer
from async_engine.ray_serve.tunnel import Forwarded, routing_key, tunnel


def sse_start(extra: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), *(extra or [])]
    return {"type": "http.response.start", "status": 200, "headers": headers}


def body(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_lone_stream_is_never_held_and_many_share_the_budget() -> None:
    pace = Pace(messages_per_s=1000.0, max_interval_s=0.05)
    assert pace.interval_s(1) == 0.0
    assert pace.interval_s(10) == pytest.approx(0.01)
    assert pace.interval_s(1000) == 0.05  # capped
    assert Pace(messages_per_s=None).interval_s(500) == 0.0


async def test_paced_send_holds_a_stream_between_messages_and_counts_them(monkeypatch) -> None:
    waits: list[float] = []

    async def record(delay: float) -> None:
        waits.append(delay)

    monkeypatch.setattr("async_engine.ray_serve.coalesce.asyncio.sleep", record)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    counts = StreamCounts(active_streams=3)  # three other streams are producing
    paced = PacedSend(send, Pace(messages_per_s=400.0), counts)
    await paced(sse_start([(b"x-request-id", b"cmpl-7")]))
    await paced(body(b"data: 1\n\n"))
    assert counts.active_streams == 3 and paced.request_id == "cmpl-7" and waits == []
    for data in (b"data: 2\n\ndata: 3\n\n", b"data: [DONE]\n\n"):
        await paced(body(data))
        assert counts.active_streams == 4
    await paced(body(b"", more=False))
    # The first message is not waited after; each later one waits 4 streams / 400 per s.
    assert waits == [pytest.approx(0.01)] * 2
    assert (counts.messages, counts.events) == (3, 4)
    assert counts.active_streams == 3 and paced.ended
    assert len(sent) == 5


async def test_a_plain_response_passes_straight_through(monkeypatch) -> None:
    async def never(delay: float) -> None:
        raise AssertionError("a JSON response is never held")

    monkeypatch.setattr("async_engine.ray_serve.coalesce.asyncio.sleep", never)
    counts = StreamCounts(active_streams=5)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    paced = PacedSend(send, Pace(messages_per_s=1.0), counts)
    start = {"type": "http.response.start", "status": 200, "headers": []}
    for message in (start, body(b"{}", more=True), body(b"{}", more=True), body(b"", False)):
        await paced(message)
    assert len(sent) == 4 and counts.messages == 0 and counts.active_streams == 5


# ------------------------------------------------------------ a sim replica in process
@pytest.fixture
async def replica(default_model: Path):
    servers: list[ReplicaServer] = []

    async def make(**options: Any) -> ReplicaServer:
        engine = {"model": str(default_model), "device": "sim", "sim_step_ms": 2.0}
        server = ReplicaServer(engine, ReplicaOptions(warmup=False, **options))
        server.app = await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.shutdown()


async def call(app: Any, path: str, payload: dict, read: int | None = None) -> list[dict]:
    """POST ``payload`` to the ASGI app; the messages it sent. With ``read``, the client
    leaves (its call is cancelled, as Serve cancels it) after that many body messages."""
    sent: list[dict] = []
    got_enough = asyncio.Event()
    raw = json.dumps(payload).encode()
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)
        bodies = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if read is not None and len(bodies) >= read:
            got_enough.set()

    headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    scope.update({"query_string": b"", "asgi": {"spec_version": "2.3"}, "http_version": "1.1"})
    task = asyncio.create_task(app(scope, receive, send))
    if read is None:
        await task
        return sent
    await got_enough.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return sent


def tokens_per_event(sent: list[dict]) -> float:
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    events = [json.loads(e[6:]) for e in text.split(b"\n\n") if e.startswith(b"data: {")]
    usage = next(e["usage"] for e in events if e.get("usage"))
    with_text = [e for e in events if e["choices"] and e["choices"][0]["text"]]
    return usage["completion_tokens"] / len(with_text)


STREAM = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 48, "stream": True}
STREAM |= {"ignore_eos": True, "stream_options": {"include_usage": True}}


async def test_a_held_stream_carries_several_tokens_per_event(replica) -> None:
    paced = await replica(messages_per_s=50.0, max_interval_s=0.02)
    paced.counts.active_streams = 1  # one more stream producing: each now waits 20 ms
    unpaced = await replica(messages_per_s=None)
    held = tokens_per_event(await call(paced.app, "/v1/completions", STREAM))
    free = tokens_per_event(await call(unpaced.app, "/v1/completions", STREAM))
    assert held >= 3 * free and free < 2, (held, free)


async def test_a_response_cut_short_aborts_its_request_at_once(replica) -> None:
    server = await replica(messages_per_s=50.0, max_interval_s=0.05)
    server.counts.active_streams = 1
    long = {**STREAM, "max_tokens": 2000}
    sent = await call(server.app, "/v1/completions", long, read=3)
    assert sent[0]["status"] == 200
    # The cancel landed while the stream waited to send: the request ended with it.
    assert not any(not r.finished for r in server.engine.scheduler.requests.values())
    assert server.counts.cut_short == 1 and server.counts.active_streams == 1


async def test_shutdown_aborts_what_runs_and_closes_the_engine(replica) -> None:
    server = await replica(messages_per_s=None)
    long = {**STREAM, "max_tokens": 5000}
    streaming = asyncio.create_task(call(server.app, "/v1/completions", long))
    while not server.engine.scheduler.running:
        await asyncio.sleep(0.01)
    assert server.health_error() is None
    await server.shutdown()
    sent = await asyncio.wait_for(streaming, 5)
    assert sent[-1] == body(b"", more=False)  # the stream ended, with its abort in-band
    assert server.state.draining
    refused = await call(server.app, "/v1/completions", STREAM)
    assert refused[0]["status"] == 503


async def test_the_tunnel_carries_a_request_and_its_streamed_answer(replica) -> None:
    server = await replica(messages_per_s=None)
    raw = json.dumps({**STREAM, "max_tokens": 4}).encode()
    headers = [(b"content-type", b"application/json")]
    request = Forwarded("POST", "/v1/completions", b"", headers, raw, routing_key("x", raw))
    batches = [batch async for batch in tunnel(server.app, request)]
    messages = [m for batch in batches for m in batch]
    assert messages[0]["status"] == 200 and messages[-1] == body(b"", more=False)
    assert tokens_per_event(messages) >= 1


def test_the_routing_key_is_the_prompt_the_chat_or_the_path() -> None:
    def key(path: str, payload: Any) -> str:
        return routing_key(path, json.dumps(payload).encode())

    assert key("/v1/completions", {"prompt": "Once upon"}) == "Once upon"
    assert key("/v1/completions", {"prompt": [1, 22, 333]}) == "1 22 333"
    chat = {"messages": [{"content": "sys. "}, {"content": [{"text": "hi"}]}]}
    assert key("/v1/chat/completions", chat) == "sys. hi"
    assert key("/v1/completions", {"prompt": ""}) == "/v1/completions"  # never empty
    assert routing_key("/v1/completions", b"{not json") == "/v1/completions"
    assert key("/v1/models", {}) == "/v1/models"


def test_serve_ray_names_the_install_command_when_ray_is_missing(monkeypatch, capsys) -> None:
    from async_engine.cli.main import main

    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(["serve-ray", "--device", "sim"]) == 2
    assert "pip install 'async-engine[ray]'" in capsys.readouterr().err
