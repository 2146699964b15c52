"""A KV event consumer's side, as vllm-router, llm-d and Dynamo read vLLM's events: a SUB
socket and plain msgpack, checking that each event has exactly vLLM's shape."""

from __future__ import annotations

import time

import msgpack
import zmq

ANY_PORT = "tcp://127.0.0.1:*"
# vLLM's field order (vllm/distributed/kv_events.py), which positional consumers index by:
# llm-d reads BlockStored[1..6], vllm-router's array decoder wants at least 8 elements.
LAYOUT = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def decode_event(raw: list | dict, encoding: str) -> dict:
    """One event as a consumer reads it, checking that its shape is exactly vLLM's."""
    if encoding == "array":
        assert isinstance(raw, list)
        tag, *values = raw
        assert len(values) == len(LAYOUT[tag])
        return {"type": tag, **dict(zip(LAYOUT[tag], values, strict=True))}
    assert isinstance(raw, dict)
    assert set(raw) == {"type", *LAYOUT[raw["type"]]}
    return raw


def receive(sub: zmq.Socket, encoding: str, timeout_ms: int = 5000) -> tuple[int, list[dict]]:
    """One message: its sequence number and its events."""
    assert sub.poll(timeout_ms), "no KV event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    ts, events, dp_rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and abs(ts - time.time()) < 60 and dp_rank == 0
    return int.from_bytes(seq, "big"), [decode_event(e, encoding) for e in events]


def subscriber(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(topic)
    sub.connect(endpoint)
    time.sleep(0.2)  # PUB/SUB: a subscription made after a message misses it
    return sub
