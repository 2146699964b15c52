"""What agent clients rely on besides tool loops keeps working: structured answers parsed into
pydantic objects (openai's ``parse``, langchain's ``with_structured_output``), and many async
streams, some left mid-way, leave nothing running. The tool loops are in
tests/test_agent_clients.py."""

from __future__ import annotations

import pytest
from agent_client_settings import FAST, langchain_chat_model

from async_engine.server.app import BackgroundServer

openai = pytest.importorskip("openai")


@pytest.fixture
def base_url(chat_server: BackgroundServer) -> str:
    return f"http://127.0.0.1:{chat_server.server.http_port}/v1"


@pytest.fixture
def client(chat_client):
    return chat_client


# ------------------------------------------------------- structured answers, kept working
class _City:
    """A pydantic model, built lazily so that collecting this file needs no pydantic."""

    @staticmethod
    def model():
        from pydantic import BaseModel, Field

        class City(BaseModel):
            name: str = Field(max_length=20)
            country: str = Field(max_length=20)

        return City


def test_openai_parse_returns_the_pydantic_object(client):
    city = _City.model()
    out = client.chat.completions.parse(
        model="default",
        response_format=city,
        **FAST,
        messages=[{"role": "user", "content": "Name a city."}],
    )
    assert isinstance(out.choices[0].message.parsed, city)


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_structured_output(base_url: str, method: str):
    city = _City.model()
    llm = langchain_chat_model(base_url).with_structured_output(
        city, method=method, include_raw=True
    )
    prompt = "Name a city. Answer in JSON with the keys name and country."
    out = llm.invoke(prompt)
    assert out["parsing_error"] is None and isinstance(out["parsed"], city)


async def test_many_async_streams_with_some_cancelled_leave_nothing_running(
    base_url: str, chat_server: BackgroundServer
):
    import asyncio

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)

    async def read(i: int) -> int:
        stream = await client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"Count to {i}"}],
            stream=True,
            temperature=0,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if i % 5 == 0 and seen == 3:  # every fifth client leaves mid-stream
                await stream.close()
                break
        return seen

    seen = await asyncio.gather(*(read(i) for i in range(50)))
    assert all(s >= 3 for s in seen)
    engine = chat_server.engine
    for _ in range(200):
        if not engine.scheduler.requests and engine.pool.num_free == engine.pool.num_blocks:
            break
        await asyncio.sleep(0.05)
    assert not engine.scheduler.requests, "no request left running"
    assert engine.pool.num_free == engine.pool.num_blocks, "every KV block back"
    await client.close()
