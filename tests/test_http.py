"""The OpenAI-compatible HTTP API, through the official `openai` client on a loopback server."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import pytest
from server_helpers import http_server, openai_client, start_server

from async_engine.core.request import FinishReason
from async_engine.server.app import BackgroundServer, ServerOptions

openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    srv = http_server(tiny_model)
    yield srv
    srv.close()


@pytest.fixture
def client(server: BackgroundServer):
    return openai_client(server)


def raw(
    server: BackgroundServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict | None = None,
) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


def wait_idle(server: BackgroundServer, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    engine = server.engine
    while time.monotonic() < deadline:
        if not engine.scheduler.requests and engine.pool.num_free == engine.pool.num_blocks:
            return True
        time.sleep(0.02)
    return False


def test_models_lists_the_served_model(client, server: BackgroundServer):
    models = client.models.list().data
    assert [m.id for m in models] == [str(server.engine.config.model)]


def test_greedy_completion_text_equals_offline_generate(client, tiny_model: Path):
    from async_engine import LLM, SamplingParams

    out = client.completions.create(
        model="default", prompt="The lighthouse", max_tokens=12, **GREEDY
    )
    with LLM(str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=512) as llm:
        want = llm.generate(
            ["The lighthouse"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        )[0]
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == "length"
    assert (
        out.usage.completion_tokens == 12 and out.usage.total_tokens == 12 + out.usage.prompt_tokens
    )


def test_token_id_prompts_are_accepted(client):
    out = client.completions.create(model="default", prompt=[5, 6, 7, 8], max_tokens=3, **GREEDY)
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 3


def test_a_chat_stream_adds_up_to_the_whole_answer_and_ends_with_usage(client):
    messages = [{"role": "user", "content": "Tell me about lighthouses"}]
    whole = client.chat.completions.create(
        model="default", messages=messages, max_tokens=10, **GREEDY
    )
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0


def test_n_two_gives_two_choices_and_a_seed_reproduces_them(client):
    ask = {
        "model": "default",
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "n": 2,
        "seed": 11,
        "temperature": 1.0,
    }
    a, b = client.completions.create(**ask), client.completions.create(**ask)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_a_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model="default", prompt="The sea", max_tokens=20, **GREEDY)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("no stable stop string in this output")
    cut = client.completions.create(
        model="default", prompt="The sea", max_tokens=20, stop=[stop], **GREEDY
    )
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert text.startswith(cut.choices[0].text)


def test_completion_logprobs_come_per_token(client):
    out = client.completions.create(
        model="default", prompt="The sea", max_tokens=4, logprobs=2, **GREEDY
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 7.0}, "top_p"),
        ({"n": 10_000}, "n"),
        ({"stop": 5}, "stop"),
        ({"stop": ["x" * 3000, "y" * 3000]}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, "x"]}, "prompt"),
        ({"echo": "yes"}, "echo"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"suffix": " the end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(server: BackgroundServer, body: dict, param: str):
    payload = {"model": "default", "prompt": "hi", **body}
    status, _, data = raw(server, "POST", "/v1/completions", json.dumps(payload).encode())
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("field", [{"echo": True}])
def test_a_chat_field_that_would_change_the_answer_is_refused(
    server: BackgroundServer, field: dict
):
    payload = {"model": "default", "messages": [{"role": "user", "content": "hi"}], **field}
    status, _, data = raw(server, "POST", "/v1/chat/completions", json.dumps(payload).encode())
    assert status == 400 and json.loads(data)["error"]["param"] == next(iter(field))


def test_harmless_defaults_of_unbuilt_fields_are_accepted(server: BackgroundServer):
    payload = {"model": "default", "prompt": "hi", "max_tokens": 2, "echo": False, "best_of": 1}
    status, _, _ = raw(server, "POST", "/v1/completions", json.dumps(payload).encode())
    assert status == 200


def test_bad_json_and_an_unknown_model_are_named(server: BackgroundServer):
    status, _, data = raw(server, "POST", "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in json.loads(data)["error"]["message"]
    body = json.dumps({"model": "nope", "prompt": "hi"}).encode()
    status, _, data = raw(server, "POST", "/v1/completions", body)
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"


def test_a_huge_body_is_refused_and_the_server_keeps_serving(server: BackgroundServer, client):
    status, _, _ = raw(server, "POST", "/v1/completions", b"x" * (5 << 20))
    assert status == 413
    assert client.completions.create(model="default", prompt="hi", max_tokens=2).choices


def test_a_draining_server_answers_503(server: BackgroundServer):
    body = json.dumps({"model": "default", "prompt": "hi"}).encode()
    state = server.server.state
    state.draining = True
    try:
        assert raw(server, "POST", "/v1/completions", body)[0] == 503
        assert raw(server, "GET", "/health")[0] == 503
    finally:
        state.draining = False
    assert raw(server, "GET", "/health")[0] == 200


def test_the_request_id_header_is_honoured(server: BackgroundServer):
    body = json.dumps({"model": "default", "prompt": "hi", "max_tokens": 2}).encode()
    status, headers, data = raw(server, "POST", "/v1/completions", body, {"x-request-id": "abc"})
    assert status == 200 and json.loads(data)["id"] == "cmpl-abc"
    assert headers["x-request-id"] == "cmpl-abc"


def test_metrics_are_served_on_the_http_port(server: BackgroundServer):
    status, _, data = raw(server, "GET", "/metrics")
    assert status == 200 and b"vllm:num_requests_waiting" in data
    assert b"vllm:kv_cache_usage_perc" in data and b'vllm:cache_config_info{block_size="16"' in data


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server: BackgroundServer):
    body = json.dumps(
        {
            "model": "default",
            "prompt": "The sea",
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # generation is under way
    (req,) = [r for r in list(server.engine.scheduler.requests.values()) if not r.finished]
    conn.close()  # the client goes away
    assert wait_idle(server), "the request's blocks did not return"
    assert req.finish_reason is FinishReason.ABORTED and len(req.output_ids) < 400


def test_a_client_that_leaves_before_its_whole_answer_aborts_it_at_once(
    server: BackgroundServer,
):
    body = json.dumps(
        {"model": "default", "prompt": "The sea", "max_tokens": 400, "ignore_eos": True}
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    running: list = []
    while not running and time.monotonic() < deadline:  # generation is under way
        running = [r for r in list(server.engine.scheduler.requests.values()) if r.output_ids]
        time.sleep(0.002)
    (req,) = running
    left = time.monotonic()
    conn.close()  # the client goes away before the answer is whole
    assert wait_idle(server), "the request's blocks did not return"
    assert req.finish_reason is FinishReason.ABORTED and len(req.output_ids) < 400
    assert req.abort_time is not None and req.abort_time - left < 0.05, "seen at once, not polled"


def test_auth_token_is_required_when_set(tiny_model: Path):
    options = ServerOptions(
        port=0, metrics_port=None, http_port=0, auth_token="s3cret", warmup=False
    )
    srv = start_server(tiny_model, options)
    try:
        base = f"http://127.0.0.1:{srv.server.http_port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
        assert good.models.list().data
    finally:
        srv.close()


async def test_bench_serve_drives_the_openai_api(server: BackgroundServer):
    from async_engine.bench.load import LoadSpec, make_requests
    from async_engine.bench.openai_load import HttpTarget, openai_sender, served_model
    from async_engine.bench.serve import on_tokens, run_load

    target = HttpTarget(f"http://127.0.0.1:{server.server.http_port}")
    send = openai_sender(target, await served_model(target), on_tokens)
    load = LoadSpec(num_requests=6, min_prompt=5, max_prompt=20, min_output=3, max_output=9)
    requests = make_requests(load, 50.0, 1000)
    records, _ = await run_load(send, requests)
    assert all(r.error is None for r in records), [r.error for r in records]
    assert [r.tokens for r in records] == [q.max_tokens for q in requests]
    assert all(r.ttft() is not None and r.ttft() > 0 for r in records)


def test_a_full_queue_is_a_429(server: BackgroundServer):
    body = json.dumps({"model": "default", "prompt": "hi", "max_tokens": 2}).encode()
    config = server.engine.config
    before, config.max_waiting = config.max_waiting, 0  # nothing more may wait
    try:
        status, _, data = raw(server, "POST", "/v1/completions", body)
    finally:
        config.max_waiting = before
    assert status == 429 and json.loads(data)["error"]["code"] == "queue_full"


def test_a_repeated_prompt_reports_its_cached_tokens(client):
    prompt = list(range(200, 264))  # 64 tokens: four full 16-token blocks
    first = client.completions.create(model="default", prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model="default", prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens < 48
    assert again.usage.prompt_tokens_details.cached_tokens >= 48


def test_a_huge_unknown_chat_role_is_named_briefly(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", messages=[{"role": "x" * 5000, "content": "hi"}], max_tokens=2
        )
    message = err.value.body["message"]
    assert "role is unknown" in message and len(message) < 200
