"""Errors that need a constrained server: auth, queue limits, message size, a failing step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from faults import fail_on
from server_helpers import check_stream_rules, collect, start_server, wait_until_idle

from async_engine.client import (
    AsyncClient,
    Chunk,
    InternalError,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
)
from async_engine.server.app import BackgroundServer, ServerOptions
from async_engine.server.codec import Limits

TOKEN = "s3cret-token"
POISON = 31337  # any step whose input holds this token fails (see faults.fail_on)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    options = ServerOptions(
        port=0,
        metrics_port=None,
        auth_token=TOKEN,
        max_message_bytes=64 * 1024,
        limits=Limits(max_prompt_chars=10_000),
    )
    srv = start_server(tiny_model, options, fail_on(POISON), max_num_seqs=1, max_waiting=1)
    yield srv
    srv.close()


@pytest.fixture
async def client(server: BackgroundServer):
    async with AsyncClient(server.address, token=TOKEN) as c:
        yield c
        await wait_until_idle(c)


async def hold_running(client: AsyncClient, request_id: str) -> asyncio.Task:
    """A long request that occupies the only running slot until cancelled."""
    started = asyncio.Event()

    async def run() -> None:
        async for event in client.generate(
            [5] * 4, request_id=request_id, max_tokens=900, **GREEDY
        ):
            if isinstance(event, Chunk):
                started.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 30)
    return task


async def stop(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ------------------------------------------------------------------- auth
@pytest.mark.parametrize(("token", "reason"), [(None, "MISSING_TOKEN"), ("wrong", "BAD_TOKEN")])
async def test_missing_or_wrong_token_is_unauthenticated(
    server: BackgroundServer, token: str | None, reason: str
) -> None:
    async with AsyncClient(server.address, token=token) as c:
        with pytest.raises(Unauthenticated) as info:
            await collect(c, [1, 2, 3], max_tokens=2)
        assert info.value.reason == reason
        with pytest.raises(Unauthenticated):
            await c.load()


def test_health_checks_need_no_token(server: BackgroundServer) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------ queue limits
async def test_full_waiting_queue_is_resource_exhausted(client: AsyncClient) -> None:
    running = await hold_running(client, "runner")
    queued = asyncio.create_task(collect(client, [6] * 4, max_tokens=2))
    await asyncio.sleep(0.2)  # the queued request now fills max_waiting=1
    with pytest.raises(ResourceExhausted) as info:
        await collect(client, [7] * 4, max_tokens=2)
    assert info.value.reason == "QUEUE_FULL"
    await stop(running)
    check_stream_rules(await asyncio.wait_for(queued, 30))  # admitted once the slot freed


async def test_not_admitted_within_max_queue_ms_is_resource_exhausted(client: AsyncClient) -> None:
    running = await hold_running(client, "runner-2")
    with pytest.raises(ResourceExhausted) as info:
        await collect(client, [6] * 4, max_tokens=2, max_queue_ms=50)
    assert info.value.reason == "QUEUE_TIMEOUT"
    await stop(running)


async def test_time_limit_ends_with_time_limit_and_keeps_partial_output(
    client: AsyncClient,
) -> None:
    t = await collect(client, [8] * 4, max_tokens=900, time_limit_ms=100, **GREEDY)
    check_stream_rules(t)
    assert t.finished[0].reason == "time_limit"
    assert 0 < len(t.tokens[0]) < 900


# ------------------------------------------------------------------ sizes
async def test_message_over_the_size_limit_is_grpc_resource_exhausted(client: AsyncClient) -> None:
    with pytest.raises(ResourceExhausted):
        await collect(client, "x" * 100_000, max_tokens=2)


async def test_text_over_the_prompt_limit_is_invalid_argument(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument) as info:
        await collect(client, "y" * 20_000, max_tokens=2)
    assert "text" in info.value.field_violations


# ------------------------------------------------------------ failed step
async def test_failed_step_is_internal_and_the_server_keeps_serving(client: AsyncClient) -> None:
    with pytest.raises(InternalError) as info:
        await collect(client, [1, POISON, 2], max_tokens=4)
    assert info.value.reason == "STEP_FAILED"
    t = await collect(client, [1, 2, 3], max_tokens=4, **GREEDY)
    check_stream_rules(t)
    assert t.finished[0].completion_tokens == 4


@pytest.mark.parametrize(
    ("request_options", "field"),
    [
        ({"prompt": "x" * ((1 << 20) + 1)}, "text"),
        ({"prompt": [1] * ((1 << 17) + 1)}, "token_ids.ids"),
        ({"messages": [{"role": "user", "content": "x" * ((1 << 20) + 1)}]}, "chat.messages"),
        ({"messages": [{"role": "user", "content": "a"}] * 1025}, "chat.messages"),
        ({"prompt": "a", "request_id": "r" * 257}, "request_id"),
        ({"prompt": "a", "tenant": "t" * 129}, "tenant"),
        ({"prompt": "a", "n": 17}, "sampling.n"),
        ({"prompt": "a", "stop": ["s"] * 65}, "stop.stop"),
        ({"prompt": "a", "stop": ["s" * 4097]}, "stop.stop"),
        ({"prompt": "a", "stop_token_ids": [1] * 257}, "stop.stop_token_ids"),
        (
            {"prompt": "a", "structured_output": ("regex", "a" * ((1 << 18) + 1))},
            "structured_output.regex",
        ),
    ],
    ids=(
        "text token-ids chat-chars chat-count request-id tenant n stop-count stop-chars "
        "stop-ids structured"
    ).split(),
)
def test_grpc_refuses_each_limit_naming_its_field(request_options, field) -> None:
    """The gRPC side of every limit HTTP applies too (tests/test_intake_off_loop.py)."""
    from async_engine.client.grpc_client import build_request
    from async_engine.server.codec import Limits, decode_request
    from async_engine.server.errors import RpcFailure

    options = dict(request_options)
    msg = build_request(options.pop("prompt", None), **options)
    with pytest.raises(RpcFailure) as info:
        decode_request(msg, Limits())
    assert info.value.code.name == "INVALID_ARGUMENT"
    violations = info.value.details[0].field_violations
    assert [v.field for v in violations] == [field]
