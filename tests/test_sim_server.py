"""256 concurrent gRPC streams on the simulated device: every token checked against the oracle."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from server_helpers import (
    Transcript,
    check_stream_rules,
    collect,
    start_server,
    token_prompts,
    wait_until_idle,
)

from async_engine.client import AsyncClient
from async_engine.server.app import BackgroundServer
from streams.sim import oracle_tokens

STREAMS = 256
SIM = {"device": "sim", "sim_step_ms": 0.3, "sim_token_us": 0, "sim_seq_us": 0, "sim_ctx_ns": 0}


@pytest.fixture(scope="module")
def sim_server(default_model: Path):
    # A pool of 120 blocks of 16 holds about ten of these requests: preemption takes part.
    srv = start_server(
        default_model, max_num_seqs=256, num_kv_blocks=120, max_num_batched_tokens=2048, **SIM
    )
    yield srv
    srv.close()


def oracle(server: BackgroundServer, prompt: list[int], count: int, seed: int) -> list[int]:
    mc = server.engine.model_config
    return oracle_tokens(prompt, count, seed, mc.vocab_size, tuple(mc.eos_token_ids))


async def cancelled_after(
    client: AsyncClient, prompt: list[int], tokens: int, **options: object
) -> Transcript:
    """Read until ``tokens`` tokens arrived, then drop the stream (the server aborts it)."""
    out = Transcript()
    stream = client.generate(prompt, **options)
    async for event in stream:
        out.add(event)
        if len(out.tokens.get(0, [])) >= tokens:
            break
    await stream.aclose()
    return out


async def test_256_streams_equal_the_oracle_under_preemption_and_cancels(
    sim_server: BackgroundServer,
):
    prompts = token_prompts(STREAMS, seed=3, lo=20, hi=200)
    leaves_early = {i for i in range(STREAMS) if i % 8 == 7}
    async with AsyncClient(sim_server.address) as client:
        jobs = []
        for i, prompt in enumerate(prompts):
            opts = {"max_tokens": 24 + i % 40, "seed": i, "ignore_eos": True}
            if i in leaves_early:
                jobs.append(cancelled_after(client, prompt, 3, **opts))
            else:
                jobs.append(collect(client, prompt, **opts))
        results = await asyncio.gather(*jobs)
        load = await wait_until_idle(client)

    for i, (prompt, t) in enumerate(zip(prompts, results, strict=True)):
        want = oracle(sim_server, prompt, 24 + i % 40, seed=i)
        got = t.tokens.get(0, [])
        if i in leaves_early:
            assert len(got) >= 3 and got == want[: len(got)], f"stream {i}: not a prefix"
        else:
            check_stream_rules(t)
            assert got == want, f"stream {i}: tokens differ from the oracle"
    assert sim_server.engine.stats().num_preemptions > 0
    assert load.free_blocks == load.total_blocks, "every block is back"
    assert not sim_server.engine.scheduler.requests, "no request outlives its stream"
