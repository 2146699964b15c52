"""The gRPC Generation service on a real loopback server (tiny float32 Llama on the CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import (
    Transcript,
    check_stream_rules,
    collect,
    start_server,
    token_prompts,
    wait_until_idle,
)

from async_engine.client import (
    AlreadyExists,
    AsyncClient,
    Chunk,
    Client,
    DeadlineExceeded,
    Finished,
    InvalidArgument,
)
from async_engine.server.app import BackgroundServer

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    srv = start_server(tiny_model)
    yield srv
    srv.close()


@pytest.fixture
async def client(server: BackgroundServer):
    async with AsyncClient(server.address) as c:
        yield c


# ------------------------------------------------------------- stream rules
async def test_many_concurrent_streams_keep_order_and_usage(client: AsyncClient) -> None:
    prompts = token_prompts(24, seed=1)
    jobs = []
    for i, prompt in enumerate(prompts):
        n = 2 if i % 4 == 0 else 1
        opts = {"max_tokens": 5 + i % 13, "n": n, "seed": i, "temperature": 0.8}
        jobs.append((n, collect(client, prompt, **opts)))
    results = await asyncio.gather(*(job for _, job in jobs))
    for (n, _), t in zip(jobs, results, strict=True):
        check_stream_rules(t, n)
        for f in t.finished.values():
            assert f.reason in ("length", "eos")
    load = await wait_until_idle(client)
    assert load.free_blocks == load.total_blocks


async def test_text_prompt_streams_detokenized_text_and_logprobs(client: AsyncClient) -> None:
    t = await collect(client, "The lighthouse keeper", max_tokens=6, logprobs=2, **GREEDY)
    check_stream_rules(t)
    assert t.accepted.prompt_tokens > 0
    assert len(t.tokens[0]) == 6 and t.text[0]
    chunks = [e for e in t.events if isinstance(e, Chunk)]
    assert all(len(c.top_logprobs) == len(c.token_ids) for c in chunks)
    assert all(len(top) == 2 for c in chunks for top in c.top_logprobs)


async def test_stop_token_is_reported_as_the_matched_stop(client: AsyncClient) -> None:
    first = await collect(client, [500, 600, 700], max_tokens=6, **GREEDY)
    stop_at = first.tokens[0][2]
    t = await collect(client, [500, 600, 700], max_tokens=6, stop_token_ids=[stop_at], **GREEDY)
    check_stream_rules(t)
    finished = t.finished[0]
    assert finished.reason == "stop" and finished.stop_token_id == stop_at
    assert t.tokens[0] == first.tokens[0][: first.tokens[0].index(stop_at) + 1]


# ----------------------------------------------------------- cancellation
async def test_cancelling_half_of_32_streams_frees_every_block_and_keeps_survivors_exact(
    client: AsyncClient,
) -> None:
    prompts = token_prompts(32, seed=2)
    opts = {"max_tokens": 24, **GREEDY}
    reference = await asyncio.gather(*(collect(client, p, **opts) for p in prompts))

    started = [asyncio.Event() for _ in prompts]

    async def run(i: int) -> Transcript:
        out = Transcript()
        async for event in client.generate(prompts[i], **opts):
            out.add(event)
            if isinstance(event, Chunk):
                started[i].set()
        return out

    tasks = [asyncio.create_task(run(i)) for i in range(32)]
    cancelled = range(1, 32, 2)
    for i in cancelled:  # mid-flight: after its first tokens, while the others still run
        await asyncio.wait_for(started[i].wait(), 30)
        tasks[i].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i in range(0, 32, 2):
        check_stream_rules(results[i])
        assert results[i].tokens[0] == reference[i].tokens[0], f"survivor {i} diverged"
    assert all(
        isinstance(results[i], asyncio.CancelledError) or results[i].finished for i in cancelled
    )
    load = await wait_until_idle(client)
    assert (load.running, load.waiting) == (0, 0)
    assert load.free_blocks == load.total_blocks, "every block of a cancelled stream returns"


async def test_deadline_aborts_the_request_and_frees_its_blocks(client: AsyncClient) -> None:
    with pytest.raises(DeadlineExceeded):
        await collect(client, [300] * 40, max_tokens=400, timeout=0.05, **GREEDY)
    load = await wait_until_idle(client)
    assert load.free_blocks == load.total_blocks


async def test_slow_reader_gets_a_contiguous_stream_and_does_not_hold_back_others(
    server: BackgroundServer, client: AsyncClient
) -> None:
    opts = {"max_tokens": 60, **GREEDY}
    done: dict[str, float] = {}
    # A tiny HTTP/2 window makes the slow reader push back on the server within a few
    # messages; with the default window the server could send all 60 before it noticed.
    small_window = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]

    async def slow() -> Transcript:
        out = Transcript()
        async with AsyncClient(server.address, options=small_window) as slow_client:
            async for event in slow_client.generate([1000, 1001, 1002], **opts):
                out.add(event)
                await asyncio.sleep(0.05)
        done["slow"] = asyncio.get_running_loop().time()
        return out

    async def fast() -> Transcript:
        out = await collect(client, [2000, 2001, 2002], **opts)
        done["fast"] = asyncio.get_running_loop().time()
        return out

    slow_t, fast_t = await asyncio.gather(slow(), fast())
    check_stream_rules(slow_t)
    check_stream_rules(fast_t)
    assert len(slow_t.tokens[0]) == 60
    chunks = [e for e in slow_t.events if isinstance(e, Chunk)]
    assert max(len(c.token_ids) for c in chunks) > 1, "queued output is coalesced"
    assert done["fast"] < done["slow"]


async def test_repeated_long_prefix_is_reported_in_accepted_cached_tokens(
    client: AsyncClient,
) -> None:
    prefix = token_prompts(1, seed=3, lo=100, hi=100)[0]
    first = await collect(client, prefix + [7, 8], max_tokens=2, **GREEDY)
    second = await collect(client, prefix + [9, 10, 11], max_tokens=2, **GREEDY)
    assert first.accepted.cached_tokens == 0
    assert second.accepted.cached_tokens >= 64
    assert second.finished[0].cached_tokens == second.accepted.cached_tokens


# ------------------------------------------------------------------ Abort
async def test_abort_ends_the_named_stream_with_aborted_and_is_idempotent(
    client: AsyncClient,
) -> None:
    first_chunk = asyncio.Event()

    async def run() -> Transcript:
        out = Transcript()
        async for event in client.generate(
            [400] * 8, request_id="abort-me", max_tokens=500, **GREEDY
        ):
            out.add(event)
            first_chunk.set()
        return out

    task = asyncio.create_task(run())
    await asyncio.wait_for(first_chunk.wait(), 30)
    assert await client.abort(["abort-me", "never-was"], reason="test") == (
        ["abort-me"],
        ["never-was"],
    )
    t = await asyncio.wait_for(task, 30)
    check_stream_rules(t)
    assert t.finished[0].reason == "aborted"
    assert len(t.tokens[0]) < 500
    assert await client.abort(["abort-me"]) == ([], ["abort-me"])


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"max_tokens": 0}, "stop.max_tokens"),
        ({"min_tokens": 9, "max_tokens": 3}, "stop.min_tokens"),
        ({"logprobs": 99}, "output.logprobs"),
        ({"stop": [""]}, "stop.stop"),
        ({"n": 1000}, "sampling.n"),
        ({"prompt": [10**6]}, "token_ids"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [5] * 2000}, "stop.max_tokens"),
        (
            {"prompt": None, "messages": [{"role": "wizard", "content": "hi"}]},
            "chat.messages[0].role",
        ),
        (  # a huge role is quoted briefly, not echoed into the status metadata
            {"prompt": None, "messages": [{"role": "w" * 5000, "content": "hi"}]},
            "chat.messages[0].role",
        ),
        ({"request_id": "x" * 300}, "request_id"),
        ({"stop": ["ab"] * 65}, "stop.stop"),
        ({"stop": ["x" * 3000, "y" * 3000]}, "stop.stop"),
        ({"stop_token_ids": list(range(300))}, "stop.stop_token_ids"),
        ({"structured_output": ("regex", "a" * 300_000)}, "structured_output.regex"),
        ({"stop_token_ids": [10**6]}, "stop.stop_token_ids"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    client: AsyncClient, options: dict, field: str
) -> None:
    prompt = options.pop("prompt", [1, 2, 3])
    with pytest.raises(InvalidArgument) as info:
        await collect(client, prompt, **options)
    assert field in info.value.field_violations, info.value.field_violations


async def test_duplicate_in_flight_request_id_is_already_exists(client: AsyncClient) -> None:
    got_chunk = asyncio.Event()

    async def hold() -> None:
        async for event in client.generate([9] * 4, request_id="dup", max_tokens=500, **GREEDY):
            if isinstance(event, Chunk):
                got_chunk.set()

    task = asyncio.create_task(hold())
    await asyncio.wait_for(got_chunk.wait(), 30)
    with pytest.raises(AlreadyExists):
        await collect(client, [1, 2], request_id="dup", max_tokens=2)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_the_id_of_an_ended_request_can_be_used_again(client: AsyncClient) -> None:
    for _ in range(3):
        async with contextlib.aclosing(
            client.generate([9] * 4, request_id="again", max_tokens=500, **GREEDY)
        ) as stream:
            async for event in stream:
                if isinstance(event, Chunk):
                    break  # closing the stream cancels the RPC mid-flight
        for _attempt in range(200):  # the id frees once the aborted request's last step ends
            try:
                t = await collect(client, [1, 2], request_id="again", max_tokens=2, **GREEDY)
                break
            except AlreadyExists:
                await asyncio.sleep(0.01)
        check_stream_rules(t)


# ------------------------------------------------------ info, health, reflection
async def test_model_info_and_load_describe_the_server(
    client: AsyncClient, server: BackgroundServer
) -> None:
    info = await client.model_info()
    engine = server.engine
    assert info.vocab_size == engine.model_config.vocab_size
    assert info.max_model_len == engine.max_model_len
    assert info.dtype == "float32" and info.device == "cpu"
    assert list(info.eos_token_ids) == list(engine.model_config.eos_token_ids)
    load = await wait_until_idle(client)
    assert load.total_blocks == 512 and load.kv_usage == 0.0


def test_health_is_serving_and_reflection_lists_the_service(server: BackgroundServer) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "async_engine.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "async_engine.v1.Generation" in services
        assert "grpc.health.v1.Health" in services


def test_sync_client_streams_and_stops_early(server: BackgroundServer) -> None:
    with Client(server.address) as client:
        events = list(client.generate([11, 12, 13], max_tokens=4, **GREEDY))
        assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 4
        for event in client.generate([11, 12, 13], max_tokens=400, **GREEDY):
            if isinstance(event, Chunk):
                break  # leaving the loop cancels the RPC


# ---------------------------------------------------------------- metrics
def scrape(server: BackgroundServer) -> dict[tuple[str, tuple], float]:
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v for (n, lbls), v in samples.items() if n == name and set(labels.items()) <= set(lbls)
    )


async def test_metrics_endpoint_shows_the_named_series_moving(
    client: AsyncClient, server: BackgroundServer
) -> None:
    before = await asyncio.to_thread(scrape, server)
    await asyncio.gather(
        *(
            collect(client, p, max_tokens=6, tenant="acme", **GREEDY)
            for p in token_prompts(8, seed=5)  # a tenant's own label takes 8 requests
        )
    )
    with pytest.raises(DeadlineExceeded):  # a cancellation, for the lag histogram
        await collect(client, [77] * 30, max_tokens=400, timeout=0.05, **GREEDY)
    await wait_until_idle(client)
    await asyncio.sleep(0.6)  # gauges and the lag histogram refresh every 0.25 s
    after = await asyncio.to_thread(scrape, server)

    def grew(name: str, **labels: str) -> bool:
        return metric(after, name, **labels) > metric(before, name, **labels)

    assert grew("vllm:request_success_total", finished_reason="length")
    assert grew("vllm:prompt_tokens_total") and grew("vllm:generation_tokens_total")
    assert grew("vllm:time_to_first_token_seconds_count")
    assert grew("vllm:inter_token_latency_seconds_count")
    assert grew("vllm:e2e_request_latency_seconds_count")
    assert grew("vllm:request_queue_time_seconds_count")
    assert grew("vllm:prefix_cache_queries_total")
    assert grew("async_engine:cancellation_lag_seconds_count")
    assert grew("async_engine:tenant_e2e_request_latency_seconds_count", tenant="acme")
    assert grew("async_engine:tenant_time_to_first_token_seconds_count", tenant="acme")
    assert grew("async_engine:tenant_service_tokens_total", tenant="acme", kind="output")
    model = str(server.engine.config.model)
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "async_engine:device_idle_fraction",
        "async_engine:kv_fragmentation",
    ):
        assert (gauge, (("model_name", model),)) in after, gauge
    assert ("vllm:num_preemptions_total", (("model_name", model),)) in after
    assert ("async_engine:wasted_tokens_total", (("model_name", model),)) in after


# -------------------------------------------------------------------- CLI
def test_cli_client_prints_one_json_line_per_message(server: BackgroundServer, capsys) -> None:
    from async_engine.cli.main import main

    argv = [
        "client",
        "Hello",
        "--target",
        server.address,
        "--max-tokens",
        "3",
        "--temperature",
        "0",
    ]
    assert main([*argv, "--ignore-eos", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["type"] for line in lines][0] == "accepted"
    assert lines[-1]["type"] == "finished" and lines[-1]["completion_tokens"] == 3


def test_cli_client_reports_errors_with_their_field(server: BackgroundServer, capsys) -> None:
    from async_engine.cli.main import main

    assert main(["client", "Hello", "--target", server.address, "--top-p", "7"]) == 1
    assert "sampling.top_p" in capsys.readouterr().err


async def test_bytes_that_are_not_protobuf_are_invalid_argument(server: BackgroundServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        generate = channel.unary_stream(
            "/async_engine.v1.Generation/Generate", request_serializer=lambda b: b
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in generate(b"\xff\xff\xff\xff garbage"):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GenerateRequest" in err.value.details()
        load = channel.unary_unary(
            "/async_engine.v1.Generation/GetLoad", request_serializer=lambda b: b
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await load(b"\x0a\xff")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
