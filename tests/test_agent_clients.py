"""The agent clients people use finish a tool loop against the server, and the chat
protocol accepts what they send (openai, openai-agents, langchain-openai, litellm).

Every loop is two turns on the default model: the first forces a call (tool_choice
required), the tool's result goes back, the second is the final answer. Structured answers
and cancelled streams are in tests/test_agent_clients_structured_and_cancelled.py.
"""

from __future__ import annotations

import json
import os

import pytest
from agent_client_settings import FAST, langchain_chat_model

from async_engine.server.app import BackgroundServer

# litellm reads its model price table from the network at import unless told otherwise.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
QUESTION = "What is the weather in Paris?"
RESULT = "Sunny, 21 C"


@pytest.fixture
def base_url(chat_server: BackgroundServer) -> str:
    return f"http://127.0.0.1:{chat_server.server.http_port}/v1"


@pytest.fixture
def client(chat_client):
    return chat_client


def _check_call(call_name: str, arguments: str) -> None:
    assert call_name == "get_weather"
    assert isinstance(json.loads(arguments)["city"], str)


# ------------------------------------------------------------------------ openai
def test_openai_sync_loop_sends_the_returned_message_back(client):
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], tool_choice="required", **FAST
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    messages.append(message)  # the documented pattern: the returned message as is
    for call in message.tool_calls:
        _check_call(call.function.name, call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": RESULT})
    final = client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], tool_choice="none", **FAST
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_openai_streamed_loop(client):
    messages = [{"role": "user", "content": QUESTION}]
    calls: dict[int, dict] = {}
    with client.chat.completions.stream(
        model="default",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        **FAST,
    ) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.done":
                calls[event.index] = {"name": event.name, "arguments": event.arguments}
        message = stream.get_final_completion().choices[0].message
    assert len(calls) == len(message.tool_calls) == 1, "parallel_tool_calls false: one call"
    _check_call(calls[0]["name"], calls[0]["arguments"])
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": RESULT})
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="default", messages=messages, stream=True, **FAST
        )
        if chunk.choices
    )
    assert text


async def test_openai_async_loop(base_url: str):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    first = await client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], tool_choice="required", **FAST
    )
    message = first.choices[0].message
    messages += [
        message,
        *({"role": "tool", "tool_call_id": c.id, "content": RESULT} for c in message.tool_calls),
    ]
    final = await client.chat.completions.create(model="default", messages=messages, **FAST)
    assert final.choices[0].message.content
    await client.close()


def test_openai_responses_loop_continues_by_previous_response_id(client):
    tool = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(
        model="default", input=QUESTION, tools=[tool], tool_choice="required",
        temperature=0, max_output_tokens=40,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls
    for call in calls:
        _check_call(call.name, call.arguments)
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": RESULT}
               for c in calls]  # fmt: skip
    with client.responses.stream(
        model="default", previous_response_id=first.id, input=results, tools=[tool],
        tool_choice="none", temperature=0, max_output_tokens=40,
    ) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.output_text and not [i for i in final.output if i.type == "function_call"]


# ------------------------------------------------------------------ openai-agents
def _agent(base_url: str, responses: bool = False, **options):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    # Enabled until it has answered: a 135M model asked again keeps calling, so the second
    # turn is the final answer (as an agent with a one-shot lookup is built).
    @agents.function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return RESULT

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    kind = agents.OpenAIResponsesModel if responses else agents.OpenAIChatCompletionsModel
    model = kind(model="default", openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60)
    agent = agents.Agent(
        name="weather",
        instructions="Answer briefly.",
        tools=[get_weather],
        model=model,
        model_settings=settings,
        **options,
    )
    return agents, agent, calls


async def test_openai_agents_runner_finishes_the_loop(base_url: str):
    agents, agent, calls = _agent(base_url)
    result = await agents.Runner.run(agent, QUESTION, max_turns=3)
    assert calls and isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds


async def test_openai_agents_responses_model_finishes_the_loop(base_url: str):
    agents, agent, calls = _agent(base_url, responses=True)
    result = await agents.Runner.run(agent, QUESTION, max_turns=3)
    assert calls and isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds


async def test_openai_agents_streamed_responses_model_finishes_the_loop(base_url: str):
    agents, agent, calls = _agent(base_url, responses=True)
    result = agents.Runner.run_streamed(agent, QUESTION, max_turns=3)
    kinds = [
        event.item.type
        async for event in result.stream_events()
        if event.type == "run_item_stream_event"
    ]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds
    assert calls and result.final_output


async def test_openai_agents_streamed_runner_finishes_the_loop(base_url: str):
    agents, agent, calls = _agent(base_url)
    result = agents.Runner.run_streamed(agent, QUESTION, max_turns=3)
    kinds = [
        event.item.type
        async for event in result.stream_events()
        if event.type == "run_item_stream_event"
    ]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds
    assert calls and result.final_output


async def test_openai_agents_typed_output_validates(base_url: str):
    from pydantic import BaseModel

    class Report(BaseModel):
        city: str
        summary: str

    agents, agent, calls = _agent(base_url, output_type=Report)
    result = await agents.Runner.run(agent, QUESTION, max_turns=3)
    assert calls and isinstance(result.final_output, Report)


# ---------------------------------------------------------------- langchain-openai
@pytest.mark.parametrize("streamed", [False, True])
def test_langchain_loop(base_url: str, streamed: bool):
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = langchain_chat_model(base_url)
    messages = [HumanMessage(QUESTION)]
    forced = llm.bind_tools([WEATHER], tool_choice="required")
    if streamed:
        chunks = list(forced.stream(messages))
        ai = chunks[0]
        for chunk in chunks[1:]:
            ai = ai + chunk
    else:
        ai = forced.invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    messages += [ai, *(ToolMessage(RESULT, tool_call_id=c["id"]) for c in ai.tool_calls)]
    final = llm.bind_tools([WEATHER], tool_choice="none").invoke(messages)
    assert final.content and not final.tool_calls


# ------------------------------------------------------------------------- litellm
def _litellm():
    litellm = pytest.importorskip("litellm")
    litellm.telemetry = False
    return litellm


@pytest.mark.parametrize("streamed", [False, True])
def test_litellm_loop(base_url: str, streamed: bool):
    litellm = _litellm()
    target = {"model": "openai/default", "api_base": base_url, "api_key": "unused", **FAST}
    messages = [{"role": "user", "content": QUESTION}]
    first = litellm.completion(
        messages=messages, tools=[WEATHER], tool_choice="required", stream=streamed, **target
    )
    if streamed:
        first = litellm.stream_chunk_builder(list(first), messages=messages)
    message = first.choices[0].message
    assert message.tool_calls
    _check_call(message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)
    messages += [
        message.model_dump(),
        *({"role": "tool", "tool_call_id": c.id, "content": RESULT} for c in message.tool_calls),
    ]
    final = litellm.completion(messages=messages, tools=[WEATHER], tool_choice="none", **target)
    assert final.choices[0].message.content


async def test_litellm_async_loop(base_url: str):
    litellm = _litellm()
    target = {"model": "openai/default", "api_base": base_url, "api_key": "unused", **FAST}
    messages = [{"role": "user", "content": QUESTION}]
    first = await litellm.acompletion(
        messages=messages, tools=[WEATHER], tool_choice="required", **target
    )
    message = first.choices[0].message
    messages += [
        message.model_dump(),
        *({"role": "tool", "tool_call_id": c.id, "content": RESULT} for c in message.tool_calls),
    ]
    final = await litellm.acompletion(messages=messages, **target)
    assert final.choices[0].message.content
