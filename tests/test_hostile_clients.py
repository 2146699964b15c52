"""Hostile clients against a live server (simulated device): fuzzed requests and random
bytes each end in a well-formed stream or a status that names the problem (never UNKNOWN
or INTERNAL), and storms of cancels leave nothing behind."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import start_server

from async_engine.client import AsyncClient, Chunk
from async_engine.server.app import BackgroundServer, ServerOptions
from async_engine.v1 import generation_pb2 as pb

ANSWERS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def server(default_model: Path):
    srv = start_server(
        default_model,
        ServerOptions(port=0, metrics_port=None),
        device="sim",
        dtype="bfloat16",
        sim_step_ms=0.2,
        sim_token_us=0,
        sim_seq_us=0,
        sim_ctx_ns=0,
        max_model_len=512,
        num_kv_blocks=256,
    )
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def channel(server: BackgroundServer):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(request_id=draw(st.sampled_from(["", "same"]) | st.text(max_size=300)))
    prompt = draw(st.sampled_from(["text", "ids", "chat", "none"]))
    if prompt == "text":
        msg.text = draw(st.text(max_size=200))
    elif prompt == "ids":
        msg.token_ids.ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=40)))
    elif prompt == "chat":
        roles = st.sampled_from(["user", "system", "assistant", "tool"]) | st.text(max_size=20)
        for role, content in draw(st.lists(st.tuples(roles, st.text(max_size=40)), max_size=4)):
            msg.chat.messages.add(role=role, content=content)
    s = msg.sampling
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if (value := draw(optional(FLOATS))) is not None:
            setattr(s, name, value)
    if (top_k := draw(optional(st.integers(-(2**31), 2**31 - 1)))) is not None:
        s.top_k = top_k
    if (seed := draw(optional(st.integers(0, 2**64 - 1)))) is not None:
        s.seed = seed
    s.n = draw(st.integers(0, 4) | st.integers(0, 2**32 - 1))
    stop = msg.stop
    if (max_tokens := draw(optional(st.integers(0, 12) | st.integers(0, 2**32 - 1)))) is not None:
        stop.max_tokens = max_tokens
    stop.min_tokens = draw(st.integers(0, 8) | st.integers(0, 2**32 - 1))
    stop.stop.extend(draw(st.lists(st.text(max_size=10), max_size=4)))
    stop.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=4)))
    stop.ignore_eos = draw(st.booleans())
    stop.include_stop_str = draw(st.booleans())
    if (logprobs := draw(optional(st.integers(0, 2**32 - 1)))) is not None:
        msg.output.logprobs = logprobs
    msg.output.skip_detokenize = draw(st.booleans())
    msg.priority = draw(st.integers(-(2**31), 2**31 - 1))
    msg.tenant = draw(st.text(max_size=200))
    if (queue_ms := draw(optional(st.integers(0, 2**32 - 1)))) is not None:
        msg.max_queue_ms = queue_ms
    if (limit_ms := draw(optional(st.integers(0, 2**32 - 1)))) is not None:
        msg.time_limit_ms = limit_ms
    kind = draw(st.sampled_from(["none", "json", "regex"]))
    if kind == "json":
        msg.structured_output.json = True
    elif kind == "regex":
        msg.structured_output.regex = draw(st.text(max_size=20))
    return msg


def send(channel: grpc.Channel, payload: bytes) -> grpc.StatusCode:
    """The RPC's final status; a stream that completes must follow the stream rules."""
    generate = channel.unary_stream(
        "/async_engine.v1.Generation/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    try:
        replies = list(generate(payload, timeout=60))
    except grpc.RpcError as err:
        return err.code()
    kinds = [r.WhichOneof("kind") for r in replies]
    assert kinds[0] == "accepted" and kinds[-1] == "finished"
    assert [r.seq for r in replies] == list(range(len(replies)))
    return grpc.StatusCode.OK


def assert_idle(server: BackgroundServer) -> None:
    engine = server.engine
    deadline = time.monotonic() + 10
    while engine.scheduler.requests or engine.num_streams or engine.pool.num_used:
        assert time.monotonic() < deadline, "the server kept requests or blocks"
        time.sleep(0.05)


@SETTINGS
@given(msg=requests())
def test_fuzzed_requests_get_a_stream_or_a_named_refusal(server, channel, msg):
    assert send(channel, msg.SerializeToString()) in ANSWERS
    assert_idle(server)


@SETTINGS
@given(payload=st.binary(max_size=300))
def test_random_bytes_on_the_wire_get_a_stream_or_a_named_refusal(server, channel, payload):
    assert send(channel, payload) in ANSWERS
    assert_idle(server)


async def test_five_storms_of_200_cancels_return_every_block_within_half_a_second(server):
    async with AsyncClient(server.address) as client:

        async def cancelled_after_first_chunk(i: int) -> None:
            async for event in client.generate([5, 6, 7, i], max_tokens=200, ignore_eos=True):
                if isinstance(event, Chunk):
                    return  # leaving the stream cancels the RPC

        for _ in range(5):
            await asyncio.gather(*(cancelled_after_first_chunk(i) for i in range(200)))
            gone = time.monotonic()
            engine = server.engine
            while engine.scheduler.requests or engine.num_streams or engine.pool.num_used:
                assert time.monotonic() - gone < 0.5, "a cancelled request kept its blocks"
                await asyncio.sleep(0.01)
