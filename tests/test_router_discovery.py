"""What a KV-aware router reads from a worker it meets: ``GET /get_server_info`` (the model
and block size its KV events belong to) and ``GET /kv_event_sources`` (where to subscribe,
keyed by data-parallel rank), in the shapes vllm-router decodes (tiny float32 Llama on the
CPU, live servers with the OpenAI HTTP API)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zmq
from kv_subscriber import ANY_PORT, receive, subscriber
from server_helpers import http_server
from test_http import raw

from async_engine.core.config import EngineConfig
from async_engine.kv_events import attach_kv_events
from async_engine.server.app import BackgroundServer
from blockalloc import BlockPool

# The fields of vllm-router's ServerInfo: it refuses a body naming a field twice, and reads
# ``block_size`` as a second name for ``kv_block_size``.
ROUTER_SERVER_INFO = {
    "model_id",
    "model_path",
    "kv_block_size",
    "instance_id",
    "priority",
    "cost",
    "worker_type",
    "effective_attention_block_size",
}
# vLLM's KVEventsConfig names, as vllm-router's KvEventSourceEntry reads them.
ROUTER_SOURCE_FIELDS = {
    "endpoint",
    "replay_endpoint",
    "topic",
    "hwm",
    "buffer_steps",
    "publisher",
    "enable_kv_cache_events",
}


@pytest.fixture(scope="module")
def publishing(tiny_model: Path):
    srv = http_server(tiny_model, block_size=4, kv_events_endpoint=ANY_PORT, kv_events_topic="t")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def silent(tiny_model: Path):
    srv = http_server(tiny_model)
    yield srv
    srv.close()


def get(server: BackgroundServer, path: str, body: dict | None = None) -> tuple[int, object]:
    """GET ``path``, or POST ``body`` to it; the status and the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    status, _, out = raw(server, "GET" if body is None else "POST", path, data)
    return status, json.loads(out)


def test_server_info_names_the_served_model_and_the_block_size(publishing) -> None:
    status, info = get(publishing, "/get_server_info")
    _, models = get(publishing, "/v1/models")
    assert status == 200
    assert info["model_id"] == models["data"][0]["id"]  # what requests name, what events key
    assert info["kv_block_size"] == 4
    assert set(info) <= ROUTER_SERVER_INFO


def test_event_sources_name_the_bound_publisher_under_rank_0(publishing) -> None:
    status, sources = get(publishing, "/kv_event_sources")
    assert status == 200
    assert list(sources) == ["0"]
    entry = sources["0"]
    assert set(entry) <= ROUTER_SOURCE_FIELDS
    assert entry["endpoint"] == publishing.engine.kv_events.endpoint
    assert entry["endpoint"].startswith("tcp://127.0.0.1:")
    assert entry["topic"] == "t"
    assert entry["publisher"] == "zmq" and entry["enable_kv_cache_events"] is True


def test_a_subscriber_at_the_discovered_endpoint_sees_a_prompts_blocks(publishing) -> None:
    _, sources = get(publishing, "/kv_event_sources")
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, sources["0"]["endpoint"], b"t")
        prompt = list(range(300, 309))  # two full blocks of 4
        status, _ = get(
            publishing, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 1}
        )
        assert status == 200
        _, events = receive(sub, "map")
        stored = [t for e in events if e["type"] == "BlockStored" for t in e["token_ids"]]
        assert stored[:8] == prompt[:8]
    finally:
        ctx.destroy(linger=0)


def test_without_events_there_are_no_sources_but_there_is_server_info(silent) -> None:
    status, body = get(silent, "/kv_event_sources")
    assert status == 404 and "no KV events" in body["error"]["message"]
    status, info = get(silent, "/get_server_info")
    assert status == 200 and info["kv_block_size"] == 16


def test_a_publisher_that_connects_out_is_no_source() -> None:
    # Sent to an indexer that binds (llm-d's layout): nothing here to subscribe to.
    config = EngineConfig(model="unused", kv_events_endpoint="tcp://127.0.0.1:9")
    events = attach_kv_events(config, BlockPool(8, 4))
    try:
        assert events.endpoint == "tcp://127.0.0.1:9"
        assert events.sources() is None
    finally:
        events.close()
