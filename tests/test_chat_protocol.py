"""The OpenAI chat protocol as clients send it, over HTTP on the default model: message
shapes, tools with response formats, only declared calls, streamed logprobs, models, 404s."""

from __future__ import annotations

import json

import pytest
from test_agent_clients import WEATHER
from test_http import raw

from async_engine.server.app import BackgroundServer

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
REPORT = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
}
REPORT_FORMAT = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT}}


def chat(client, messages: list, **options):
    return client.chat.completions.create(
        model="default", messages=messages, **{**GREEDY, **options}
    )


# ------------------------------------------------------------------ message shapes
@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool", "developer"])
def test_content_as_text_parts_is_accepted_for_every_role(chat_client, role: str):
    parts = [{"type": "text", "text": "The weather"}, {"type": "text", "text": "is fine."}]
    messages = [{"role": role, "content": parts, "name": "someone"}]
    if role == "tool":
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
        messages = [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": parts},
        ]
    as_parts = chat(chat_client, [*messages, {"role": "user", "content": "And?"}])
    joined = [
        dict(m, content="The weather\nis fine.") if m.get("content") == parts else m
        for m in messages
    ]
    as_text = chat(chat_client, [*joined, {"role": "user", "content": "And?"}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content


def test_an_image_part_is_refused_naming_it(chat_client):
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with pytest.raises(openai.BadRequestError) as err:
        chat(chat_client, [{"role": "user", "content": [image]}])
    assert err.value.body["param"] == "messages" and "image_url" in err.value.body["message"]


@pytest.mark.parametrize("field", ["functions", "function_call"])
def test_the_deprecated_functions_api_is_refused_naming_it(chat_client, field: str):
    value = [WEATHER["function"]] if field == "functions" else "auto"
    with pytest.raises(openai.BadRequestError) as err:
        chat(chat_client, [{"role": "user", "content": "Hi"}], extra_body={field: value})
    assert err.value.body["param"] == field


def test_an_assistant_call_without_content_key_is_accepted(chat_client):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Rain"},
    ]
    assert chat(chat_client, messages, tools=[WEATHER]).choices[0].message.content


# --------------------------------------------------------------------- tool calls
@pytest.mark.parametrize(
    "call",
    [
        {"name": "delete_all_files", "arguments": {"path": "/"}},  # not among the tools
        {"name": "get_weather", "arguments": {"town": "Paris"}},
    ],  # off get_weather's schema
)
def test_an_echoed_call_that_is_not_a_valid_declared_one_comes_back_as_text(chat_client, call):
    block = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    messages = [
        {"role": "user", "content": "Repeat after me: " + block},
        {"role": "assistant", "content": block},
        {"role": "user", "content": "Again, exactly: " + block},
    ]
    out = chat(chat_client, messages, tools=[WEATHER], max_tokens=40, extra_body={})
    choice = out.choices[0]
    assert choice.message.content == block, "the model echoed the call"
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"


def test_a_text_answer_under_auto_streams_as_it_comes(chat_client):
    text = "Lighthouses guide ships home at night."
    messages = [
        {"role": "user", "content": "Repeat after me: " + text},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Again, exactly: " + text},
    ]
    options = {"tools": [WEATHER], "max_tokens": 20, "extra_body": {}}
    whole = chat(chat_client, messages, **options).choices[0]
    chunks = [
        c.choices[0] for c in chat(chat_client, messages, stream=True, **options) if c.choices
    ]
    pieces = [c.delta.content for c in chunks if c.delta.content]
    assert whole.message.tool_calls is None and whole.message.content.startswith("Lighthouses")
    assert len(pieces) > 3, "token by token, not held until the end"
    assert "".join(pieces) == whole.message.content
    assert chunks[-1].finish_reason == whole.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_a_response_format_answers_a_call_or_the_format(chat_client, stream: bool):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {
        "tools": [WEATHER],
        "tool_choice": "auto",
        "response_format": REPORT_FORMAT,
        "max_tokens": 60,
        "extra_body": {},
    }
    if stream:
        with chat_client.chat.completions.stream(
            model="default", messages=messages, temperature=0, **options
        ) as events:
            message = events.get_final_completion().choices[0].message
    else:
        message = chat(chat_client, messages, **options).choices[0].message
    if message.tool_calls:
        for call in message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(
                json.loads(call.function.arguments), WEATHER["function"]["parameters"]
            )
    else:
        jsonschema.validate(json.loads(message.content), REPORT)


def test_tool_choice_none_keeps_the_response_format(chat_client):
    out = chat(
        chat_client,
        [{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="none",
        response_format=REPORT_FORMAT,
        max_tokens=60,
        extra_body={},
    )
    assert out.choices[0].message.tool_calls is None
    jsonschema.validate(json.loads(out.choices[0].message.content), REPORT)


def test_a_grammar_with_auto_tools_is_refused_naming_the_conflict(chat_client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(
            chat_client,
            [{"role": "user", "content": "Hi"}],
            tools=[WEATHER],
            extra_body={"guided_grammar": 'root ::= "yes"'},
        )
    assert err.value.body["param"] == "guided_grammar"


# ----------------------------------------------------------------------- logprobs
def test_streamed_chat_logprobs_equal_the_whole_answers(chat_client):
    messages = [{"role": "user", "content": "Tell me about lighthouses"}]
    options = {"logprobs": True, "top_logprobs": 3}
    whole = chat(chat_client, messages, **options).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in chat(chat_client, messages, stream=True, **options)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert len(whole) == 8 and [e.model_dump() for e in streamed] == [e.model_dump() for e in whole]


def test_streamed_completion_logprobs_equal_the_whole_answers(chat_client):
    options = {"model": "default", "prompt": "The lighthouse", "logprobs": 2, **GREEDY}
    whole = chat_client.completions.create(**options).choices[0].logprobs
    merged: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for chunk in chat_client.completions.create(stream=True, **options):
        for key, values in merged.items():
            values += getattr(chunk.choices[0].logprobs, key)
    assert len(whole.tokens) == 8
    assert merged == {key: getattr(whole, key) for key in merged}


def test_top_logprobs_over_the_limit_is_named(chat_client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(chat_client, [{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=50)
    assert err.value.body["param"] == "top_logprobs"


# ------------------------------------------------------------------ models and 404s
def test_a_model_is_retrieved_by_its_id(chat_client, chat_server: BackgroundServer):
    name = str(chat_server.engine.config.model)
    assert chat_client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as err:
        chat_client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nothing", 404), ("DELETE", "/v1/chat/completions", 405)],
)
def test_unknown_routes_and_methods_answer_in_openais_error_shape(
    chat_server: BackgroundServer, method: str, path: str, status: int
):
    got, headers, body = raw(chat_server, method, path)
    error = json.loads(body)["error"]
    assert got == status and set(error) == {"message", "type", "param", "code"}
    assert path in error["message"]
    if status == 405:
        assert "POST" in headers.get("allow", "")
