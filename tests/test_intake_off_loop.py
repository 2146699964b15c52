"""What a client sends is prepared off the event loop, and refused cheaply when it cannot fit:
a long chat must not freeze the other streams, on either front end."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import start_server

from async_engine.client import AsyncClient, InvalidArgument
from async_engine.server.app import BackgroundServer, ServerOptions

# About 0.6 M characters: inside the context's character bound (8192 tokens x the longest
# token), so it is templated and tokenized (about half a second each) before the token count
# refuses it.
LONG_CHAT = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 240}
             for i in range(500)]  # fmt: skip


@pytest.fixture(scope="module")
def server(default_model: Path):
    srv = start_server(default_model, ServerOptions(port=0, metrics_port=None, http_port=0),
                       device="sim", dtype="bfloat16", sim_step_ms=0.2, sim_token_us=0,
                       sim_seq_us=0, sim_ctx_ns=0, num_kv_blocks=256)  # fmt: skip
    yield srv
    srv.close()


def _url(server: BackgroundServer, path: str) -> str:
    return f"http://127.0.0.1:{server.server.http_port}{path}"


def _worst_poll_while(server: BackgroundServer, work) -> float:
    """The slowest of GET /v1/models polled every 20 ms while ``work`` runs in threads: the
    server's event loop answers it, so its latency is the loop's stall."""
    threads = [threading.Thread(target=work) for _ in range(3)]
    worst = 0.0
    with httpx.Client(timeout=30) as client:
        client.get(_url(server, "/v1/models"))  # connected, warm
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            start = time.perf_counter()
            client.get(_url(server, "/v1/models"))
            worst = max(worst, time.perf_counter() - start)
            time.sleep(0.02)
    for t in threads:
        t.join()
    return worst


def test_long_http_chats_leave_the_event_loop_free(server):
    answers = []

    def chat() -> None:
        body = {"model": "default", "messages": LONG_CHAT, "max_tokens": 1}
        answers.append(httpx.post(_url(server, "/v1/chat/completions"), json=body, timeout=60))

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
    answer = httpx.post(_url(server, "/v1/chat/completions"), timeout=60,
                        json={"model": "default", "messages": huge})  # fmt: skip
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages" and "refused before templating" in error["message"]
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x" * (1 << 20 | 1)}, "prompt"),
        ("/v1/completions", {"prompt": [1] * ((1 << 17) + 1)}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (1 << 20 | 1)}]},
         "messages"),
        ("/v1/completions", {"prompt": "a", "guided_regex": "a" * (1 << 18 | 1)}, "guided_regex"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
             "enum": ["v" * 1000] * 300}}}}, "response_format"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
         "tools": [{"type": "function", "function": {"name": "f", "description": "d" * (1 << 18),
                                                      "parameters": {"type": "object"}}}]},
         "tools"),
        ("/v1/completions", {"prompt": "a", "stop": ["s"] * 65}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": ["s" * 4097]}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": [1] * 257}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "a", "n": 17}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 1025},
         "messages"),
        ("/v1/completions", {"prompt": "a", "user": "u" * 129}, "user"),
    ],
    ids=["text", "token-ids", "chat", "regex", "schema", "tools", "stop-count", "stop-chars",
         "stop-ids", "n", "message-count", "tenant"],
)  # fmt: skip
def test_http_applies_the_servers_size_limits(server, path, body, param):
    answer = httpx.post(_url(server, path), json={"model": "default", **body}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param
    assert any(w in error["message"] for w in ("longer than", "more than", "at most"))


def test_http_refuses_a_request_id_longer_than_the_limit(server):
    body = {"model": "default", "prompt": "a", "max_tokens": 1}
    answer = httpx.post(_url(server, "/v1/completions"), json=body, timeout=60,
                        headers={"x-request-id": "r" * 257})  # fmt: skip
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "x-request-id"


def test_http_takes_stop_token_ids(server):
    body = {"model": "default", "prompt": [5, 6], "max_tokens": 8, "stop_token_ids": [7]}
    assert httpx.post(_url(server, "/v1/completions"), json=body, timeout=60).status_code == 200


# ------------------------------------------------------------------ odd bodies: 4xx, never 5xx
def _post_raw(server: BackgroundServer, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(_url(server, path), content=raw, timeout=60,
                      headers={"content-type": "application/json"})  # fmt: skip


def test_a_body_nested_100k_deep_is_a_400(server):
    raw = b'{"model": "default", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    answer = _post_raw(server, "/v1/completions", raw)
    assert answer.status_code == 400 and "nests too deeply" in answer.json()["error"]["message"]


def test_a_schema_nested_5000_deep_is_a_400(server):
    schema = '{"type": "array", "items": ' * 5000 + '{"type": "string"}' + "}" * 5000
    raw = ('{"model": "default", "messages": [{"role": "user", "content": "a"}], '
           '"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": '
           + schema + "}}}").encode()  # fmt: skip
    answer = _post_raw(server, "/v1/chat/completions", raw)
    assert answer.status_code == 400


@pytest.mark.parametrize(
    ("path", "field"),
    [("/v1/completions", '"prompt": "\\ud800x"'),
     ("/v1/chat/completions", '"messages": [{"role": "user", "content": "a\\udfffb"}]'),
     ("/v1/completions", '"prompt": "x", "stop": ["\\ud83d"]')],
    ids=["prompt", "chat", "stop"],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_not_a_500(server, path, field):
    answer = _post_raw(server, path, ('{"model": "default", ' + field + "}").encode())
    assert answer.status_code == 400
    assert "surrogate" in answer.json()["error"]["message"]


def test_a_paired_surrogate_escape_is_one_character_and_welcome(server):
    raw = b'{"model": "default", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    assert _post_raw(server, "/v1/completions", raw).status_code == 200


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "stop", "n", "seed",
          "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "user",
          "stream", "stream_options", "guided_regex", "guided_grammar", "priority",
          "logit_bias", "max_completion_tokens"]  # fmt: skip


@given(
    chat=st.booleans(),
    body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=5),
)
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
def test_fuzzed_http_bodies_get_an_answer_or_a_4xx_never_a_5xx(server, chat, body):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "default", **body, "stream": False, "max_tokens": 2}
    answer = httpx.post(_url(server, path), json=body, timeout=60)
    assert answer.status_code < 500, answer.text


# ------------------------------------------------------------------ slow clients
@pytest.fixture(scope="module")
def strict_server(default_model: Path):
    options = ServerOptions(port=0, metrics_port=None, http_port=0, http_header_timeout_s=0.5,
                            http_body_timeout_s=0.5)  # fmt: skip
    srv = start_server(default_model, options, device="sim", dtype="bfloat16", sim_step_ms=0.2,
                       sim_token_us=0, sim_seq_us=0, sim_ctx_ns=0, num_kv_blocks=64)  # fmt: skip
    yield srv
    srv.close()


def _socket(server: BackgroundServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10)


def test_a_client_sending_its_headers_a_byte_at_a_time_is_cut_off(strict_server):
    start = time.monotonic()
    with _socket(strict_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for byte in b"X-Slow: " + b"a" * 40:  # 0.1 s a byte: 4 s if nobody stops it
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # the server closed the socket
                closed = True
                break
            time.sleep(0.1)
            sock.setblocking(False)
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
    assert closed and time.monotonic() - start < 2.5


def test_a_body_that_never_ends_is_a_408(strict_server):
    with _socket(strict_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"model": "default", ')  # fmt: skip
        start = time.monotonic()
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 2.5


def test_a_client_within_the_timeouts_is_served_and_kept_alive(strict_server):
    with httpx.Client(base_url=_url(strict_server, ""), timeout=10) as client:
        for _ in range(3):  # one connection: the deadline re-arms after each response
            body = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 2}
            assert client.post("/v1/completions", json=body).status_code == 200
            time.sleep(0.3)


@pytest.mark.parametrize("raw", [b"5", b"[1, 2]", b'"tools"', b"null"], ids=str)
def test_a_body_that_is_not_an_object_is_a_400(server, raw):
    answer = _post_raw(server, "/v1/chat/completions", raw)
    assert answer.status_code == 400 and "JSON object" in answer.json()["error"]["message"]


def test_more_tools_than_openai_allows_are_refused_naming_tools(server):
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object"}}} for i in range(129)]  # fmt: skip
    body = {"model": "default", "messages": [{"role": "user", "content": "a"}], "tools": tools}
    answer = httpx.post(_url(server, "/v1/chat/completions"), json=body, timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "tools" and "128" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content_type", "status"),
    [("text/plain", 415), ("application/x-www-form-urlencoded", 415),
     ("application/json; charset=utf-8", 200), (None, 200)],
)  # fmt: skip
def test_only_json_bodies_are_read_as_json(server, content_type, status):
    raw = b'{"model": "default", "prompt": [5, 6], "max_tokens": 1}'
    headers = {"content-type": content_type} if content_type else {}
    with httpx.Client(timeout=60) as client:
        request = client.build_request("POST", _url(server, "/v1/completions"), content=raw,
                                       headers=headers)  # fmt: skip
        if content_type is None and "content-type" in request.headers:
            del request.headers["content-type"]
        assert client.send(request).status_code == status


def test_a_request_id_that_is_not_ascii_is_refused_not_echoed_garbled(server):
    body = {"model": "default", "prompt": "a", "max_tokens": 1}
    answer = httpx.post(_url(server, "/v1/completions"), json=body, timeout=60,
                        headers={"x-request-id": "caf\xe9".encode("latin-1")})  # fmt: skip
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "x-request-id"
