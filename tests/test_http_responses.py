"""The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) through the
official openai client: text, the streamed event sequence, function tools, structured
output, a conversation continued by previous_response_id, the store and its limits, and a
client that leaves. Tiny Llama, live HTTP server."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import pytest
from server_helpers import http_server, openai_client
from test_http import raw, wait_idle

from async_engine.core.request import FinishReason
from async_engine.server.app import BackgroundServer

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
GREEDY = {"temperature": 0}
LONG = {"extra_body": {"ignore_eos": True}}  # every answer max_output_tokens long


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    srv = http_server(tiny_model)
    yield srv
    srv.close()


@pytest.fixture
def client(server: BackgroundServer):
    return openai_client(server)


def respond(client, **ask):
    return client.responses.create(model="default", **{"max_output_tokens": 6, **GREEDY, **ask})


def post(server, body: dict) -> tuple[int, dict]:
    status, _, out = raw(server, "POST", "/v1/responses", json.dumps(body).encode())
    return status, json.loads(out)


def test_a_text_input_answers_one_message_with_its_usage(client):
    r = respond(client, input="Tell me about lighthouses", **LONG)
    assert r.object == "response" and r.id.startswith("resp_")
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_the_answer_is_the_chat_completion_of_the_same_conversation(client):
    r = respond(client, input="Tell me about lighthouses", instructions="Be brief.")
    chat = client.chat.completions.create(
        model="default", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Tell me about lighthouses"}],
    )  # fmt: skip
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stream_sends_the_event_sequence_the_sdk_parses(client):
    events = list(respond(client, input="Tell me about lighthouses", stream=True, **LONG))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == respond(client, input="Tell me about lighthouses", **LONG).output_text
    assert events[-1].response.output_text == text


def test_a_required_tool_is_a_function_call_item_with_valid_arguments(client):
    r = respond(client, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                max_output_tokens=60)  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and isinstance(json.loads(call.arguments)["city"], str)


def test_a_streamed_call_comes_with_its_argument_events(client):
    with client.responses.stream(
        model="default", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=60, temperature=0,
    ) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"]


def test_previous_response_id_continues_the_conversation_with_the_tool_result(client):
    first = respond(client, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                    max_output_tokens=60)  # fmt: skip
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    second = respond(client, previous_response_id=first.id, input=[result], tools=[WEATHER],
                     tool_choice="none")  # fmt: skip
    whole = respond(
        client,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments}, result],
        tools=[WEATHER], tool_choice="none",
    )  # fmt: skip
    assert second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens


def test_instructions_are_not_inherited_by_a_later_response(client):
    first = respond(client, input="Hi", instructions="Answer in French, always and briefly.")
    later = respond(client, input="And again?", previous_response_id=first.id)
    again = respond(
        client,
        input=[{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And again?"}],
    )  # fmt: skip
    assert later.usage.input_tokens == again.usage.input_tokens  # no system message carried


def test_a_json_schema_format_constrains_the_text(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    r = respond(client, input="A number", max_output_tokens=40,
                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})  # fmt: skip
    assert isinstance(json.loads(r.output_text)["n"], int)


def test_a_stored_response_is_read_back_and_deleted(client, server):
    r = respond(client, input="Hello")
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    status, _, out = raw(server, "GET", f"/v1/responses/{r.id}")
    assert status == 404 and json.loads(out)["error"]["param"] == "response_id"


def test_a_response_not_stored_cannot_be_continued(client, server):
    r = respond(client, input="Hello", store=False)
    status, answer = post(
        server, {"model": "default", "input": "More", "previous_response_id": r.id}
    )
    assert status == 404 and answer["error"]["param"] == "previous_response_id"


def test_the_store_keeps_the_latest_responses_only(client, server):
    store = server.server.http_app.responses
    before, store.max_responses = store.max_responses, 2
    try:
        ids = [respond(client, input=f"Hello {i}", max_output_tokens=1).id for i in range(3)]
    finally:
        store.max_responses = before
    status, _, out = raw(server, "GET", f"/v1/responses/{ids[0]}")
    assert status == 404 and "evicted" in json.loads(out)["error"]["message"]
    assert client.responses.retrieve(ids[2]).id == ids[2]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text"),
        ({"input": "hi", "max_output_tokens": -1}, "max_tokens"),
        ({"input": "hi", "store": "yes"}, "store"),
    ],
)
def test_a_bad_body_is_a_400_naming_its_field(server, body, param):
    status, answer = post(server, {"model": "default", **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param


def test_a_client_that_leaves_before_its_response_aborts_it(server):
    body = json.dumps({"model": "default", "input": "The sea", "max_output_tokens": 400,
                       "ignore_eos": True}).encode()  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    conn.request("POST", "/v1/responses", body, {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    running: list = []
    while not running and time.monotonic() < deadline:
        running = [r for r in list(server.engine.scheduler.requests.values()) if r.output_ids]
        time.sleep(0.002)
    (req,) = running
    conn.close()
    assert wait_idle(server), "the request's blocks did not return"
    assert req.finish_reason is FinishReason.ABORTED and len(req.output_ids) < 400
