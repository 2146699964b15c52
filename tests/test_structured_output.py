"""Structured output and tool calls: grammars applied on the device, under overlap."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from server_helpers import http_server, openai_client

from async_engine import LLM, SamplingParams
from async_engine.server.app import BackgroundServer
from async_engine.server.http.tools import ToolSpec

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
    },
    "nested-with-enum": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "genre": {"enum": ["novel", "poem", "essay"]},
            "meta": {
                "type": "object",
                "properties": {"year": {"type": "integer"}, "pages": {"type": "integer"}},
                "required": ["year", "pages"],
            },
        },
        "required": ["title", "genre", "meta"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
        },
        "required": ["tags"],
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(default_model: Path):
    srv = http_server(default_model, dtype="bfloat16", device_threads=2)
    yield srv
    srv.close()


@pytest.fixture
def client(server: BackgroundServer):
    return openai_client(server)


def ask(client, content: str, **options):
    options = {"temperature": 0, "max_tokens": 120, **options}
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], **options
    )


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_parses_and_validates(client, name: str):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
    out = ask(client, "Describe a book as JSON", response_format=fmt)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS[name])
    assert out.choices[0].finish_reason == "stop"


def test_json_object_output_is_an_object(client):
    # A short answer: an open-ended one ("describe a cat") nested forever on some CPUs'
    # greedy path and met max_tokens mid-object.
    out = ask(
        client,
        'Give a JSON object with one key, "name", whose value is "Tom".',
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_a_regex_constrains_a_completion(client):
    out = client.completions.create(
        model="default",
        prompt="My phone number is",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r"\d{3}-\d{4}"},
    )
    assert re.fullmatch(r"\d{3}-\d{4}", out.choices[0].text)


YES_NO = 'root ::= answer "."\nanswer ::= "yes" | "no"'


def test_an_ebnf_grammar_constrains_a_completion(client):
    out = client.completions.create(
        model="default",
        prompt="Is the sea salty?",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_grammar": YES_NO},
    )
    assert out.choices[0].text in ("yes.", "no.")


def test_a_lark_grammar_constrains_a_chat_answer(client):
    lark = 'start: "The answer is " DIGIT "."\nDIGIT: /[0-9]/'
    out = ask(client, "What is two plus two?", max_tokens=12, extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"The answer is [0-9]\.", out.choices[0].message.content)


def test_a_required_tool_call_parses_into_the_tools_arguments(client):
    out = ask(
        client, "What is the weather in Paris?", tools=[WEATHER, TIME], tool_choice="required"
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls, "at least one call"
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.function.name in ("get_weather", "get_time")
        tool = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_parallel_tool_calls_false_gives_exactly_one_call(client):
    out = ask(
        client,
        "What is the weather in Paris?",
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1


def test_a_named_tool_choice_calls_that_tool_also_when_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(
        ask(client, "Weather in Rome?", tools=[WEATHER, TIME], tool_choice=choice, stream=True)
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_schema_that_does_not_compile_is_a_400(server: BackgroundServer, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "hi", response_format=fmt)
    assert err.value.body["param"] == "response_format"
    assert ask(client, "hi", max_tokens=2).choices  # and the server keeps serving


def test_bad_tool_specs_are_named(client):
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "hi", tools=[{"type": "function"}])
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as err:
        ask(
            client,
            "hi",
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert err.value.body["param"] == "tool_choice"


def test_auto_tool_choice_parses_hermes_tool_call_blocks():
    spec = ToolSpec([WEATHER], "auto")
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    content, calls = spec.parse(text)
    assert content == "Sure." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert spec.parse("no call here") == ("no call here", [])


def test_constrained_and_free_requests_share_overlapped_steps(default_model: Path):
    # Under overlap the device advances each row's grammar itself; outputs of the
    # constrained rows must validate however they are batched with free ones.
    schema = SCHEMAS["nested-with-enum"]
    spec = ("json_schema", json.dumps(schema))
    constrained = SamplingParams(temperature=0.8, seed=3, max_tokens=120, structured_output=spec)
    free = SamplingParams(temperature=0.8, seed=4, max_tokens=40)
    prompts = [f"Book number {i} as JSON:" for i in range(8)]
    params = [constrained if i % 2 == 0 else free for i in range(8)]
    with LLM(str(default_model), dtype="bfloat16", max_num_batched_tokens=32) as llm:
        outs = llm.generate(prompts, params)
    for i, out in enumerate(outs):
        if i % 2 == 0:
            jsonschema.validate(json.loads(out.text), schema)


def test_structured_output_refuses_ignore_eos():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_output=("json", ""))
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output=("yaml", ""))


async def test_grpc_generate_takes_a_json_schema(server: BackgroundServer):
    from server_helpers import collect

    from async_engine.client import AsyncClient, InvalidArgument

    schema = SCHEMAS["flat"]
    async with AsyncClient(server.address) as grpc_client:
        out = await collect(
            grpc_client,
            "A person as JSON:",
            max_tokens=80,
            temperature=0.0,
            structured_output=("json_schema", json.dumps(schema)),
        )
        jsonschema.validate(json.loads(out.text[0]), schema)
        with pytest.raises(InvalidArgument) as err:
            await collect(grpc_client, "x", structured_output=("regex", "[a-"))
        assert "structured_output" in str(err.value)


async def test_grpc_generate_takes_an_ebnf_grammar(server: BackgroundServer):
    from server_helpers import collect

    from async_engine.client import AsyncClient

    async with AsyncClient(server.address) as grpc_client:
        out = await collect(
            grpc_client,
            "Is the sea salty?",
            max_tokens=10,
            temperature=0.0,
            structured_output=("grammar", YES_NO),
        )
    assert out.text[0] in ("yes.", "no.")
