"""Ray Serve with two sim replicas, through the shipped ``start_replicas`` / ``build_app``,
behind Serve's proxy and behind its HAProxy ingress: streamed completions and chats
without errors, a client that leaves aborts its request within a second, and (through the
proxy, where each event is a Ray message) events carry several tokens under load.

Slow (Ray starts: ~15 s): ``pytest -m slow tests/test_ray_serve.py``. Skipped without Ray.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the 'ray' extra)")

from async_engine.bench.openai_load import HttpTarget  # noqa: E402

pytestmark = pytest.mark.slow


# (ingress, router): Serve's proxy, its HAProxy ingress, and the prefix-affinity layout
# (an ingress deployment before the replicas).
LAYOUTS = [("proxy", "default"), ("haproxy", "default"), ("proxy", "prefix-affinity")]


@pytest.fixture(scope="module", params=LAYOUTS, ids=["proxy", "haproxy", "prefix-affinity"])
def ray_url(request: pytest.FixtureRequest, default_model: Path):
    from async_engine.ray_serve.launch import start_replicas

    ingress, router = request.param
    engine = {"model": str(default_model), "device": "sim", "sim_step_ms": 2.0}
    url, stop = start_replicas(
        2, engine, router=router, ingress=ingress, graceful_shutdown_timeout_s=5.0
    )
    yield url
    stop()


def replica_stats(replicas: int = 2, calls: int = 64) -> list[dict[str, Any]]:
    """Stats of each of the ``replicas`` replicas, once each (Serve picks one per call, so
    it is asked until every one has answered)."""
    from ray import serve

    deployments = serve.status().applications["async-engine"].deployments
    name = "EngineDeployment" if "EngineDeployment" in deployments else "EngineReplica"
    handle = serve.get_deployment_handle(name, app_name="async-engine")
    seen: dict[int, dict[str, Any]] = {}
    for _ in range(calls):
        stats = handle.stats.remote().result(timeout_s=10)
        seen[stats["pid"]] = stats
        if len(seen) == replicas:
            return list(seen.values())
    raise AssertionError(f"{calls} calls reached {len(seen)} of {replicas} replicas")


async def stream(target: HttpTarget, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed answer: its text events, its usage and its finish reason."""
    events, usage, reason = 0, None, None
    async for event in target.events(path, {**body, "stream": True}):
        assert "error" not in event, event
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            events += bool(piece)
            reason = choice.get("finish_reason") or reason
    return {"events": events, "usage": usage, "finish_reason": reason}


COMMON = {"model": "default", "max_tokens": 32, "ignore_eos": True}
COMMON |= {"stream_options": {"include_usage": True}}


async def test_two_replicas_stream_completions_and_chats_without_errors(ray_url: str) -> None:
    target = HttpTarget(ray_url)
    completions = [
        stream(target, "/v1/completions", {**COMMON, "prompt": f"Story {i}:"}) for i in range(12)
    ]
    chat = {"messages": [{"role": "user", "content": "Hello"}]}
    chats = [stream(target, "/v1/chat/completions", {**COMMON, **chat}) for _ in range(12)]
    answers = await asyncio.gather(*completions, *chats, return_exceptions=True)
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert errors == []
    for answer in answers:
        assert answer["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 32
    whole = json.loads(
        b"".join(
            [p async for p in target.request("POST", "/v1/chat/completions", {**COMMON, **chat})]
        )
    )
    assert whole["choices"][0]["message"]["content"]


def test_a_client_that_leaves_aborts_its_request_within_a_second(ray_url: str) -> None:
    host, port = ray_url.removeprefix("http://").split(":")
    body = json.dumps(
        {**COMMON, "prompt": "Tell me everything", "max_tokens": 3000, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = sum(s["cut_short"] for s in replica_stats())
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        seen = b""
        while seen.count(b"data: {") < 5:
            seen += sock.recv(65536)
        left_at = time.time()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = replica_stats()
        done = [s for s in stats if s["last_cut_short_at"] >= left_at]
        if done:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"no replica saw the client leave: {stats}")
    lag = done[0]["last_cut_short_at"] - left_at
    assert lag < 1.0, f"the request was aborted {lag:.2f} s after the client left"
    assert sum(s["cut_short"] for s in stats) == before + 1
    time.sleep(0.5)
    assert all(s["running"] == 0 for s in replica_stats()), "nothing runs once it is aborted"


async def test_events_carry_several_tokens_under_load(
    ray_url: str, request: pytest.FixtureRequest
) -> None:
    if request.node.callspec.id == "haproxy":
        pytest.skip("behind HAProxy an event is no Ray message: nothing is held back")
    target = HttpTarget(ray_url)
    body = {**COMMON, "max_tokens": 64}
    answers = await asyncio.gather(
        *(stream(target, "/v1/completions", {**body, "prompt": [100 + i] * 8}) for i in range(96))
    )
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    events = sum(a["events"] for a in answers)
    assert tokens == 96 * 64
    assert tokens / events > 1.0, f"{tokens / events:.2f} tokens per streamed event"
