"""vLLM's render endpoints: the token ids a request would run, as prefix-aware routers
(vllm-router's kv_aware) ask each worker for them. Tiny Llama, live HTTP server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_helpers import http_server
from test_http import raw

from async_engine.server.app import BackgroundServer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    srv = http_server(tiny_model)
    yield srv
    srv.close()


def post(server: BackgroundServer, path: str, body: dict) -> tuple[int, object]:
    status, _, out = raw(server, "POST", path, json.dumps(body).encode())
    return status, json.loads(out)


def prompt_tokens(server: BackgroundServer, path: str, body: dict) -> int:
    status, answer = post(server, path, {**body, "max_tokens": 1})
    assert status == 200, answer
    return answer["usage"]["prompt_tokens"]


def test_a_text_prompt_renders_to_the_ids_a_completion_runs(server):
    body = {"model": "default", "prompt": "The quick brown fox jumps over"}
    status, answer = post(server, "/v1/completions/render", body)
    assert status == 200
    (rendered,) = answer
    assert rendered["token_ids"] == server.engine.tokenizer.encode(body["prompt"])
    assert len(rendered["token_ids"]) == prompt_tokens(server, "/v1/completions", body)


def test_a_chat_renders_through_the_models_template(server):
    body = {"model": "default", "messages": CHAT}
    status, answer = post(server, "/v1/chat/completions/render", body)
    assert status == 200
    assert answer["token_ids"] == server.engine.tokenizer.apply_chat_template(CHAT)
    assert len(answer["token_ids"]) == prompt_tokens(server, "/v1/chat/completions", body)


def test_token_ids_render_to_themselves_and_nothing_is_generated(server):
    status, answer = post(
        server, "/v1/completions/render", {"model": "default", "prompt": [5, 6, 7]}
    )
    assert status == 200 and answer[0]["token_ids"] == [5, 6, 7]
    assert not server.engine.scheduler.requests


def test_an_unknown_model_or_an_empty_prompt_is_refused_by_name(server):
    status, answer = post(server, "/v1/completions/render", {"model": "nope", "prompt": "hi"})
    assert status == 404 and answer["error"]["param"] == "model"
    status, answer = post(server, "/v1/completions/render", {"model": "default", "prompt": ""})
    assert status == 400 and answer["error"]["param"] == "prompt"
