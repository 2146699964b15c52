"""What benchmark tools and eval harnesses send beside one prompt: a batch of prompts (each
prompt's n choices at i*n..i*n+n-1, as OpenAI indexes them), usage on every streamed chunk
(stream_options.continuous_usage_stats) and the model card's creation time. Tiny Llama,
live HTTP server, the official client."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from server_helpers import http_server, openai_client
from test_http import raw, wait_idle

from async_engine.server.app import BackgroundServer

openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["The lighthouse", "Once upon a time there", "In the beginning"]


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    started = int(time.time())
    srv = http_server(tiny_model)
    srv.started = started
    yield srv
    srv.close()


@pytest.fixture
def client(server: BackgroundServer):
    return openai_client(server)


def one(client, prompt, **ask) -> object:
    return client.completions.create(model="default", prompt=prompt, max_tokens=6, **GREEDY, **ask)


def test_a_batch_of_text_prompts_answers_each_as_it_would_alone(client):
    batch = one(client, PROMPTS)
    alone = [one(client, p) for p in PROMPTS]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 18


def test_a_batch_of_token_id_prompts_is_taken(client):
    batch = one(client, [[5, 6, 7], [8, 9]])
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == 5
    assert batch.choices[1].text == one(client, [8, 9]).choices[0].text


def test_prompt_i_has_choices_i_times_n_to_i_times_n_plus_n_minus_1(client):
    ask = {"n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 6}
    batch = client.completions.create(model="default", prompt=PROMPTS[:2], **ask)
    second = client.completions.create(model="default", prompt=PROMPTS[1], **ask)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices[2:]] == [c.text for c in second.choices]


def test_a_streamed_batch_indexes_its_chunks_the_same_way(client):
    stream = one(client, PROMPTS, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in one(client, PROMPTS).choices]


@pytest.mark.parametrize("prompt", [[], ["ok", ""], ["ok", [1, "x"]], [["ok"]], [True]], ids=str)
def test_a_bad_batch_is_a_400_naming_the_prompt(server, prompt):
    body = {"model": "default", "prompt": prompt, "max_tokens": 2}
    status, _, data = raw(server, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400 and json.loads(data)["error"]["param"] == "prompt"


def test_a_batch_over_the_choice_limit_is_refused_and_nothing_runs(server):
    body = {"model": "default", "prompt": ["a"] * 20, "n": 16, "max_tokens": 2}
    status, _, data = raw(server, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400 and json.loads(data)["error"]["param"] == "prompt"
    assert wait_idle(server)


def test_a_batch_the_engine_refuses_in_part_queues_none_of_it(server):
    too_long = [1] * (server.engine.max_model_len + 1)
    body = {"model": "default", "prompt": [[5, 6], too_long], "max_tokens": 2}
    status, _, data = raw(server, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400, data
    assert wait_idle(server)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Tell me about lighthouses"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        **GREEDY,
    )
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chunks)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 8
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)  # fmt: skip


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(client):
    stream = one(client, "The lighthouse", stream=True, stream_options={"include_usage": True})
    usages = [c.usage for c in stream]
    assert all(u is None for u in usages[:-1]) and usages[-1].completion_tokens == 6


def test_a_stream_option_that_is_not_a_bool_is_named(server):
    body = {"model": "default", "prompt": "hi", "stream": True,
            "stream_options": {"continuous_usage_stats": "yes"}}  # fmt: skip
    status, _, data = raw(server, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400 and json.loads(data)["error"]["param"] == "stream_options"


def test_the_model_card_says_when_the_server_started(client, server):
    (card,) = client.models.list().data
    assert server.started <= card.created <= int(time.time())
