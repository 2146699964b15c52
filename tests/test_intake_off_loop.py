"""What a client sends is prepared off the event loop, and refused cheaply when it cannot fit:
a long chat must not freeze the other streams, on either front end. Odd bodies and slow
clients are in tests/test_http_odd_bodies_and_slow_clients.py."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from intake_servers import http_url, sim_http_server

from async_engine.client import AsyncClient, InvalidArgument
from async_engine.server.app import BackgroundServer, ServerOptions

# About 0.6 M characters: inside the context's character bound (8192 tokens x the longest
# token), so it is templated and tokenized (about half a second each) before the token count
# refuses it.
LONG_CHAT = [
    {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 240} for i in range(500)
]


@pytest.fixture(scope="module")
def server(default_model: Path):
    srv = sim_http_server(
        default_model, ServerOptions(port=0, metrics_port=None, http_port=0), num_kv_blocks=256
    )
    yield srv
    srv.close()


def _worst_poll_while(server: BackgroundServer, work) -> float:
    """The slowest of GET /v1/models polled every 20 ms while ``work`` runs in threads: the
    server's event loop answers it, so its latency is the loop's stall."""
    threads = [threading.Thread(target=work) for _ in range(3)]
    worst = 0.0
    with httpx.Client(timeout=30) as client:
        client.get(http_url(server, "/v1/models"))  # connected, warm
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            start = time.perf_counter()
            client.get(http_url(server, "/v1/models"))
            worst = max(worst, time.perf_counter() - start)
            time.sleep(0.02)
    for t in threads:
        t.join()
    return worst


def test_long_http_chats_leave_the_event_loop_free(server):
    answers = []

    def chat() -> None:
        body = {"model": "default", "messages": LONG_CHAT, "max_tokens": 1}
        answers.append(httpx.post(http_url(server, "/v1/chat/completions"), json=body, timeout=60))

    worst = _worst_poll_while(server, chat)
    assert [a.status_code for a in answers] == [400] * 3  # too many tokens, found off the loop
    assert "context length" in answers[0].json()["error"]["message"]
    assert worst < 0.2, f"the event loop stalled {worst:.3f} s"


def test_long_grpc_chats_leave_the_event_loop_free(server):
    errors = []

    def chat() -> None:
        async def one() -> None:
            async with AsyncClient(server.address) as client:
                try:
                    async for _ in client.generate(messages=LONG_CHAT, max_tokens=1):
                        pass
                except InvalidArgument as exc:
                    errors.append(exc)

        asyncio.run(one())

    worst = _worst_poll_while(server, chat)
    assert len(errors) == 3
    assert worst < 0.2, f"the event loop stalled {worst:.3f} s"


def test_a_chat_whose_text_cannot_fit_is_refused_before_templating(server):
    huge = [{"role": "user", "content": "x" * 900_000}]  # over 8192 x the longest token
    start = time.perf_counter()
    answer = httpx.post(
        http_url(server, "/v1/chat/completions"),
        timeout=60,
        json={"model": "default", "messages": huge},
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages" and "refused before templating" in error["message"]
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x" * (1 << 20 | 1)}, "prompt"),
        ("/v1/completions", {"prompt": [1] * ((1 << 17) + 1)}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * (1 << 20 | 1)}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": "a", "guided_regex": "a" * (1 << 18 | 1)}, "guided_regex"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "a"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"enum": ["v" * 1000] * 300}},
                },
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "a"}],
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "description": "d" * (1 << 18),
                            "parameters": {"type": "object"},
                        },
                    }
                ],
            },
            "tools",
        ),
        ("/v1/completions", {"prompt": "a", "stop": ["s"] * 65}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": ["s" * 4097]}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": [1] * 257}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "a", "n": 17}, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}] * 1025},
            "messages",
        ),
        ("/v1/completions", {"prompt": "a", "user": "u" * 129}, "user"),
    ],
    ids=[
        "text",
        "token-ids",
        "chat",
        "regex",
        "schema",
        "tools",
        "stop-count",
        "stop-chars",
        "stop-ids",
        "n",
        "message-count",
        "tenant",
    ],
)
def test_http_applies_the_servers_size_limits(server, path, body, param):
    answer = httpx.post(http_url(server, path), json={"model": "default", **body}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param
    assert any(w in error["message"] for w in ("longer than", "more than", "at most"))


def test_http_refuses_a_request_id_longer_than_the_limit(server):
    body = {"model": "default", "prompt": "a", "max_tokens": 1}
    answer = httpx.post(
        http_url(server, "/v1/completions"),
        json=body,
        timeout=60,
        headers={"x-request-id": "r" * 257},
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "x-request-id"


def test_http_takes_stop_token_ids(server):
    body = {"model": "default", "prompt": [5, 6], "max_tokens": 8, "stop_token_ids": [7]}
    assert httpx.post(http_url(server, "/v1/completions"), json=body, timeout=60).status_code == 200


def test_more_tools_than_openai_allows_are_refused_naming_tools(server):
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(129)
    ]
    body = {"model": "default", "messages": [{"role": "user", "content": "a"}], "tools": tools}
    answer = httpx.post(http_url(server, "/v1/chat/completions"), json=body, timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "tools" and "128" in answer.json()["error"]["message"]


def test_a_request_id_that_is_not_ascii_is_refused_not_echoed_garbled(server):
    body = {"model": "default", "prompt": "a", "max_tokens": 1}
    answer = httpx.post(
        http_url(server, "/v1/completions"),
        json=body,
        timeout=60,
        headers={"x-request-id": "caf\xe9".encode("latin-1")},
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "x-request-id"
