"""Helpers shared by the gRPC server tests: a live server and checks of the stream rules."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_engine.client import Accepted, AsyncClient, Chunk, Event, Finished
from async_engine.core.engine import AsyncEngine
from async_engine.server.app import BackgroundServer, ServerOptions
from streams.device import Device


def start_server(
    model: Path,
    options: ServerOptions | None = None,
    device_wrapper: Callable[[Device], Device] | None = None,
    **engine: Any,
) -> BackgroundServer:
    settings: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "device": "cpu",
        "num_kv_blocks": 512,
        "max_num_seqs": 32,
        "device_threads": 1,
        **engine,
    }
    options = options or ServerOptions(port=0, metrics_port=0)
    return BackgroundServer(AsyncEngine(device_wrapper=device_wrapper, **settings), options)


def http_server(model: Path, **engine: Any) -> BackgroundServer:
    """A live server with the OpenAI HTTP API on a free port (and gRPC)."""
    return start_server(model, ServerOptions(port=0, metrics_port=None, http_port=0), **engine)


def openai_client(server: BackgroundServer) -> Any:
    """The official client pointed at the server's HTTP API, without retries."""
    import openai

    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="unused", max_retries=0
    )


def token_prompts(count: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@dataclass(slots=True)
class Transcript:
    """Every event of one Generate call, and the per-index outputs they add up to."""

    events: list[Event] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)

    def add(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, Chunk):
            self.tokens.setdefault(event.index, []).extend(event.token_ids)
            self.text[event.index] = self.text.get(event.index, "") + event.text
        elif isinstance(event, Finished):
            self.finished[event.index] = event

    @property
    def accepted(self) -> Accepted:
        first = self.events[0]
        assert isinstance(first, Accepted)
        return first


async def collect(client: AsyncClient, prompt: Any = None, **options: Any) -> Transcript:
    out = Transcript()
    async for event in client.generate(prompt, **options):
        out.add(event)
    return out


def check_stream_rules(t: Transcript, n: int = 1) -> None:
    """The contract of every Generate stream that ends with status OK."""
    assert [e.seq for e in t.events] == list(range(len(t.events))), "seq counts 0, 1, 2, ..."
    assert isinstance(t.events[0], Accepted), "Accepted comes first"
    assert not any(isinstance(e, Accepted) for e in t.events[1:]), "exactly one Accepted"
    expected = {i: 0 for i in range(n)}
    seen_finished: set[int] = set()
    for e in t.events[1:]:
        assert e.index in expected, f"index {e.index} out of range"
        assert e.index not in seen_finished, "nothing follows an index's Finished"
        if isinstance(e, Chunk):
            assert e.offset == expected[e.index], "offsets are contiguous: no gap, no duplicate"
            if e.logprobs:
                assert len(e.logprobs) == len(e.token_ids)
            expected[e.index] += len(e.token_ids)
        else:
            seen_finished.add(e.index)
            assert e.completion_tokens == expected[e.index], "usage counts what was streamed"
            assert e.prompt_tokens == t.accepted.prompt_tokens
    assert seen_finished == set(range(n)), "exactly one Finished per index"


async def wait_until_idle(client: AsyncClient, timeout: float = 10.0) -> Any:
    """GetLoad once nothing runs and every block is back (blocks free a step after an end)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        load = await client.load()
        idle = load.running == 0 and load.waiting == 0 and load.free_blocks == load.total_blocks
        if idle or asyncio.get_running_loop().time() > deadline:
            return load
        await asyncio.sleep(0.02)
