"""Metrics and load are the same whichever front end a request came by: gRPC and OpenAI
HTTP requests are counted once each, gauges read 0 when idle, and ``GET /get_load`` agrees
with gRPC ``GetLoad`` (tiny float32 Llama on the CPU, one live server with both APIs)."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import start_server, token_prompts

from async_engine.client import AsyncClient, Client, Finished
from async_engine.core.group import RequestOptions
from async_engine.server.app import BackgroundServer, ServerOptions
from async_engine.v1 import generation_pb2 as pb
from sampler.params import SamplingParams

N = 4  # requests per front end
MAX_TOKENS = 3
Samples = dict[tuple[str, tuple], float]
SUCCESS = "vllm:request_success_total"


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    srv = start_server(tiny_model, ServerOptions(port=0, metrics_port=0, http_port=0))
    yield srv
    srv.close()


# ------------------------------------------------------------------ helpers
def call_http(server: BackgroundServer, method: str, path: str, body: dict | None = None) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.read()
    conn.close()
    assert resp.status == 200, out
    return out


def scrape(server: BackgroundServer, port: int | None = None) -> Samples:
    """The metrics of the HTTP app's /metrics, or of the separate metrics ``port``."""
    if port is None:
        text = call_http(server, "GET", "/metrics").decode()
    else:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        v for (n, lbls), v in samples.items() if n == name and labels.items() <= dict(lbls).items()
    )


def settle(
    read: Callable[[], Samples], done: Callable[[Samples], bool], timeout: float = 10.0
) -> Samples:
    """Samples once ``done`` holds: a request's metrics land when its front end lets go of
    it, which may be a moment after its client saw the end."""
    deadline = time.monotonic() + timeout
    samples = read()
    while not done(samples) and time.monotonic() < deadline:
        time.sleep(0.02)
        samples = read()
    return samples


def get_load(server: BackgroundServer) -> int:
    return json.loads(call_http(server, "GET", "/get_load"))["load"]


# ----------------------------------------------------------------- counting
def test_http_and_grpc_requests_are_each_counted_once(server: BackgroundServer) -> None:
    prompts = token_prompts(2 * N, seed=24)
    before = scrape(server)
    for i, prompt in enumerate(prompts[:N]):  # half streamed, half whole
        body = {
            "model": "default",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": i % 2 == 1,
        }
        call_http(server, "POST", "/v1/completions", body)
    with Client(server.address) as client:
        for prompt in prompts[N:]:
            events = list(
                client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            )
            assert isinstance(events[-1], Finished) and events[-1].reason == "length"

    def grown(samples: Samples, name: str, **labels: str) -> float:
        return metric(samples, name, **labels) - metric(before, name, **labels)

    after = settle(
        lambda: scrape(server), lambda s: grown(s, "vllm:request_success_total") >= 2 * N
    )
    time.sleep(0.3)  # nothing more may land: no request is counted twice
    after = scrape(server)
    assert grown(after, "vllm:request_success_total") == 2 * N
    assert grown(after, "vllm:request_success_total", finished_reason="length") == 2 * N
    assert grown(after, "vllm:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert grown(after, "vllm:generation_tokens_total") == 2 * N * MAX_TOKENS
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert grown(after, f"{histogram}_count") == 2 * N, histogram


def test_every_finished_reason_series_exists_from_the_start(tiny_model: Path) -> None:
    srv = start_server(tiny_model, ServerOptions(port=0, metrics_port=0, http_port=0))
    try:
        samples = scrape(srv)
        model = str(srv.engine.config.model)
        for reason in ("stop", "length", "abort", "error"):
            key = (
                "vllm:request_success_total",
                (("finished_reason", reason), ("model_name", model)),
            )
            assert samples[key] == 0.0  # the warm-up request is the server's own: not counted
        # A fresh idle server: no request waits or runs, on either metrics endpoint.
        for port in (None, srv.server.metrics_port):
            for gauge in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
                idle = settle(
                    lambda p=port: scrape(srv, p), lambda s, g=gauge: metric(s, g) == 0, 2.0
                )
                assert metric(idle, gauge) == 0, (gauge, port)
        assert metric(scrape(srv), "vllm:num_requests_waiting") == 0  # HTTP: read at the scrape
    finally:
        srv.close()


def test_an_aborted_request_is_counted_as_abort(server: BackgroundServer) -> None:
    before = scrape(server)
    with Client(server.address) as client:
        events = client.generate([7] * 20, max_tokens=500, temperature=0.0, ignore_eos=True)
        next(events)  # Accepted: the request runs
        events.close()  # cancels the RPC: the server aborts the request
    after = settle(
        lambda: scrape(server),
        lambda s: metric(s, SUCCESS) > metric(before, SUCCESS),
    )
    reasons = {
        reason: metric(after, SUCCESS, finished_reason=reason)
        - metric(before, SUCCESS, finished_reason=reason)
        for reason in ("stop", "length", "abort", "error")
    }
    assert reasons == {"stop": 0, "length": 0, "abort": 1, "error": 0}


# ------------------------------------------------------------------- gauges
def test_waiting_and_running_return_to_zero_when_idle(server: BackgroundServer) -> None:
    prompts = token_prompts(6, seed=7)

    async def burst() -> None:
        async with AsyncClient(server.address) as client:
            await asyncio.gather(*(_drain(client, p, 20) for p in prompts))

    asyncio.run(burst())
    for port in (None, server.server.metrics_port):
        for gauge in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
            idle = settle(
                lambda p=port: scrape(server, p), lambda s, g=gauge: metric(s, g) == 0, 3.0
            )
            assert metric(idle, gauge) == 0, (gauge, port)
    assert metric(scrape(server), "vllm:num_requests_running") == 0  # HTTP: no refresh lag
    assert get_load(server) == 0


def test_cache_config_names_the_block_size_and_the_block_count(server: BackgroundServer) -> None:
    pool = server.engine.pool
    for port in (None, server.server.metrics_port):
        infos = [
            lbls for (n, lbls), _ in scrape(server, port).items() if n == "vllm:cache_config_info"
        ]
        assert len(infos) == 1
        labels = dict(infos[0])
        assert labels["block_size"] == str(pool.block_size) == "16"
        assert labels["num_gpu_blocks"] == str(pool.num_blocks) == "512"


def test_prefix_cache_counters_count_tokens(server: BackgroundServer) -> None:
    prompt = token_prompts(1, seed=99, lo=40, hi=40)[0]  # 2 full blocks of 16 (+ 8 tokens)
    before = scrape(server)
    with Client(server.address) as client:
        for _ in range(2):  # the second finds the first's two full blocks
            events = list(client.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True))
    assert events[0].cached_tokens == 32
    after = scrape(server)
    queried = metric(after, "vllm:prefix_cache_queries_total") - metric(
        before, "vllm:prefix_cache_queries_total"
    )
    hit = metric(after, "vllm:prefix_cache_hits_total") - metric(
        before, "vllm:prefix_cache_hits_total"
    )
    assert (queried, hit) == (2 * 32, 32)  # tokens of full blocks, as vLLM counts tokens


# --------------------------------------------------------------------- load
def test_get_load_is_grpc_getloads_running_plus_waiting(server: BackgroundServer) -> None:
    state = server.server.state

    async def queue_three() -> tuple[int, pb.Load]:
        # No await between the submissions and the reads: no step can admit anything.
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        groups = [state.submit([5, 6, 7], params, f"load-{i}", RequestOptions()) for i in range(3)]
        try:
            return state.load(), await server.server.service.GetLoad(pb.GetLoadRequest(), None)
        finally:
            for group in groups:
                group.release()

    load, grpc_load = server.call(queue_three())
    assert load == grpc_load.running + grpc_load.waiting == 3


async def test_get_load_over_http_follows_the_requests_in_flight(server: BackgroundServer) -> None:
    assert await asyncio.to_thread(get_load, server) == 0
    async with AsyncClient(server.address) as client:
        jobs = [
            asyncio.create_task(_drain(client, p, 600))
            for p in token_prompts(4, seed=3, lo=5, hi=9)
        ]
        try:
            seen = await _load_while_steady(server, client)
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        assert 0 < seen <= 4
        deadline = time.monotonic() + 5
        while (await client.load()).running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    assert await asyncio.to_thread(get_load, server) == 0


async def _load_while_steady(server: BackgroundServer, client: AsyncClient) -> int:
    """/get_load read between two equal GetLoads (nothing changed meanwhile): it must equal
    their running + waiting."""
    for _ in range(200):
        first = await client.load()
        http_load = await asyncio.to_thread(get_load, server)
        second = await client.load()
        same = (first.running, first.waiting) == (second.running, second.waiting)
        if same and first.running + first.waiting > 0:
            assert http_load == first.running + first.waiting
            return http_load
    pytest.fail("the requests never held still long enough to compare")


async def _drain(client: AsyncClient, prompt: list[int], max_tokens: int) -> None:
    async for _ in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        pass
