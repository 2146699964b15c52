"""HTTP bodies that are odd (nested deep, lone surrogates, not objects, not JSON, fuzzed) get a
4xx, never a 5xx; clients too slow with their headers or body are cut off, and those within
the timeouts are served."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from intake_servers import http_url, sim_http_server

from async_engine.server.app import BackgroundServer, ServerOptions


@pytest.fixture(scope="module")
def server(default_model: Path):
    srv = sim_http_server(
        default_model, ServerOptions(port=0, metrics_port=None, http_port=0), num_kv_blocks=256
    )
    yield srv
    srv.close()


# ------------------------------------------------------------------ odd bodies: 4xx, never 5xx
def _post_raw(server: BackgroundServer, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(
        http_url(server, path),
        content=raw,
        timeout=60,
        headers={"content-type": "application/json"},
    )


def test_a_body_nested_100k_deep_is_a_400(server):
    raw = b'{"model": "default", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    answer = _post_raw(server, "/v1/completions", raw)
    assert answer.status_code == 400 and "nests too deeply" in answer.json()["error"]["message"]


def test_a_schema_nested_5000_deep_is_a_400(server):
    schema = '{"type": "array", "items": ' * 5000 + '{"type": "string"}' + "}" * 5000
    raw = (
        '{"model": "default", "messages": [{"role": "user", "content": "a"}], '
        '"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": '
        + schema
        + "}}}"
    ).encode()
    answer = _post_raw(server, "/v1/chat/completions", raw)
    assert answer.status_code == 400


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", '"prompt": "\\ud800x"'),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": "a\\udfffb"}]'),
        ("/v1/completions", '"prompt": "x", "stop": ["\\ud83d"]'),
    ],
    ids=["prompt", "chat", "stop"],
)
def test_a_lone_surrogate_is_a_400_not_a_500(server, path, field):
    answer = _post_raw(server, path, ('{"model": "default", ' + field + "}").encode())
    assert answer.status_code == 400
    assert "surrogate" in answer.json()["error"]["message"]


def test_a_paired_surrogate_escape_is_one_character_and_welcome(server):
    raw = b'{"model": "default", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    assert _post_raw(server, "/v1/completions", raw).status_code == 200


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "n",
    "seed",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "user",
    "stream",
    "stream_options",
    "guided_regex",
    "guided_grammar",
    "priority",
    "logit_bias",
    "max_completion_tokens",
]


@given(
    chat=st.booleans(),
    body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=5),
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_fuzzed_http_bodies_get_an_answer_or_a_4xx_never_a_5xx(server, chat, body):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "default", **body, "stream": False, "max_tokens": 2}
    answer = httpx.post(http_url(server, path), json=body, timeout=60)
    assert answer.status_code < 500, answer.text


@pytest.mark.parametrize("raw", [b"5", b"[1, 2]", b'"tools"', b"null"], ids=str)
def test_a_body_that_is_not_an_object_is_a_400(server, raw):
    answer = _post_raw(server, "/v1/chat/completions", raw)
    assert answer.status_code == 400 and "JSON object" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("application/json; charset=utf-8", 200),
        (None, 200),
    ],
)
def test_only_json_bodies_are_read_as_json(server, content_type, status):
    raw = b'{"model": "default", "prompt": [5, 6], "max_tokens": 1}'
    headers = {"content-type": content_type} if content_type else {}
    with httpx.Client(timeout=60) as client:
        request = client.build_request(
            "POST", http_url(server, "/v1/completions"), content=raw, headers=headers
        )
        if content_type is None and "content-type" in request.headers:
            del request.headers["content-type"]
        assert client.send(request).status_code == status


# ------------------------------------------------------------------ slow clients
@pytest.fixture(scope="module")
def strict_server(default_model: Path):
    options = ServerOptions(
        port=0, metrics_port=None, http_port=0, http_header_timeout_s=0.5, http_body_timeout_s=0.5
    )
    srv = sim_http_server(default_model, options, num_kv_blocks=64)
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
            except ConnectionResetError:  # closed while bytes were still arriving: a reset
                closed = True
                break
            finally:
                sock.setblocking(True)
    assert closed and time.monotonic() - start < 2.5


def test_a_body_that_never_ends_is_a_408(strict_server):
    with _socket(strict_server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            b'{"model": "default", '
        )
        start = time.monotonic()
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 2.5


def test_a_client_within_the_timeouts_is_served_and_kept_alive(strict_server):
    with httpx.Client(base_url=http_url(strict_server, ""), timeout=10) as client:
        for _ in range(3):  # one connection: the deadline re-arms after each response
            body = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 2}
            assert client.post("/v1/completions", json=body).status_code == 200
            time.sleep(0.3)
