"""vLLM's /tokenize and /detokenize: the server's own token counts, as benchmark and eval
tools ask for them; the tokenizer's answers, checked against transformers' own. Tiny Llama
with the default model's tokenizer, live HTTP server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_helpers import http_server
from test_http import raw
from transformers import AutoTokenizer

from async_engine.server.app import BackgroundServer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    srv = http_server(tiny_model)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def hf(tiny_model: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def template_ids(hf, generation_prompt: bool) -> list[int]:
    ids = hf.apply_chat_template(CHAT, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def post(server: BackgroundServer, path: str, body: dict) -> tuple[int, dict]:
    status, _, out = raw(server, "POST", path, json.dumps(body).encode())
    return status, json.loads(out)


def test_a_prompt_tokenizes_as_transformers_does_with_the_count_and_context(server, hf):
    status, answer = post(server, "/tokenize", {"model": "default", "prompt": TEXT})
    assert status == 200
    assert answer["tokens"] == hf(TEXT)["input_ids"]
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == server.engine.max_model_len
    assert answer["token_strs"] is None


def test_token_strings_are_the_vocabulary_entries(server, hf):
    status, answer = post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert status == 200
    assert answer["token_strs"] == hf.convert_ids_to_tokens(answer["tokens"])


def test_messages_tokenize_through_the_chat_template_as_a_chat_completion_counts(server, hf):
    status, answer = post(server, "/tokenize", {"messages": CHAT})
    assert status == 200
    assert answer["tokens"] == template_ids(hf, True)
    status, done = post(
        server, "/v1/chat/completions", {"model": "default", "messages": CHAT, "max_tokens": 1}
    )
    assert status == 200 and done["usage"]["prompt_tokens"] == answer["count"]


def test_without_the_generation_prompt_the_assistant_header_is_left_out(server, hf):
    status, answer = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert status == 200
    assert answer["tokens"] == template_ids(hf, False)


def test_detokenize_gives_back_the_text_special_tokens_kept(server, hf):
    ids = template_ids(hf, True)
    status, answer = post(server, "/detokenize", {"model": "default", "tokens": ids})
    assert status == 200
    assert answer["prompt"] == hf.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in answer["prompt"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": TEXT, "messages": CHAT}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": ""}, "prompt"),
        ("/tokenize", {"prompt": [1, 2]}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": TEXT, "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "nope"}]}, "tools"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [1, True]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_a_bad_body_is_a_400_naming_its_field(server, path, body, param):
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param


def test_an_unknown_model_is_a_404(server):
    status, answer = post(server, "/tokenize", {"model": "nope", "prompt": TEXT})
    assert status == 404 and answer["error"]["param"] == "model"


def test_a_prompt_over_the_character_limit_is_refused_before_tokenizing(server):
    most = server.server.state.limits.max_prompt_chars
    status, answer = post(server, "/tokenize", {"prompt": "a" * (most + 1)})
    assert status == 400 and answer["error"]["param"] == "prompt"
