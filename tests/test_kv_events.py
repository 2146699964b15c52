"""KV events in vLLM's format: what the block pool reports, and what a subscriber decodes
off the wire (tests/kv_subscriber.py reads it as vllm-router, llm-d and Dynamo do)."""

from __future__ import annotations

import asyncio
import re

import msgpack
import pytest
import zmq
from kv_subscriber import ANY_PORT, receive, subscriber

from async_engine.core.config import EngineConfig
from async_engine.kv_events import NO_KV_EVENTS, attach_kv_events
from async_engine.kv_events.publisher import ZmqPublisher
from blockalloc import BlockPool, block_hashes


class Recorder:
    """A pool listener that keeps what it hears."""

    def __init__(self) -> None:
        self.heard: list[tuple] = []

    def stored(self, hashes, parent, token_ids):
        self.heard.append(("stored", hashes, parent, list(token_ids)))

    def removed(self, hashes):
        self.heard.append(("removed", hashes))

    def cleared(self):
        self.heard.append(("cleared",))


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def offer(pool: BlockPool, blocks: list[int], hashes: list[int], parent, tokens) -> None:
    """Register filled blocks and report those that joined, as the KV cache manager does."""
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.register(block, block_hash)
    if pool.events is not None:
        pool.report_joined(blocks, hashes, parent, tokens)


def filled(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Fresh blocks for ``tokens``' full blocks, offered to the prefix cache."""
    hashes = block_hashes(tokens, pool.block_size)
    blocks = pool.allocate(len(hashes))
    offer(pool, blocks, hashes, None, tokens[: len(hashes) * pool.block_size])
    return blocks


# ------------------------------------------------------------------ the pool's reports
def test_the_pool_reports_runs_of_blocks_that_joined_with_their_tokens_and_parent():
    pool, heard = BlockPool(8, 2), Recorder()
    pool.events = heard
    first = filled(pool, [1, 2, 3, 4])
    h = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert heard.heard == [("stored", h[:2], None, [1, 2, 3, 4])]
    # Another request with the same start: its copy of block 1 is not cached (one hash, one
    # block), so only the blocks after it join, reported as a run whose parent is h[1].
    heard.heard.clear()
    offer(pool, pool.allocate(4), h, None, [1, 2, 3, 4, 5, 6, 7, 8])
    assert heard.heard == [("stored", h[2:], h[1], [5, 6, 7, 8])]
    pool.free(first[::-1])
    pool.check_invariants()


def test_the_pool_reports_a_run_broken_by_a_block_already_cached_as_two_runs():
    pool, heard = BlockPool(8, 1), Recorder()
    pool.events = heard
    h = block_hashes([1, 2, 3], 1)
    pool.register(pool.allocate(1)[0], h[1])  # the middle one is cached already
    offer(pool, pool.allocate(3), h, None, [1, 2, 3])
    assert heard.heard == [("stored", [h[0]], None, [1]), ("stored", [h[2]], h[1], [3])]


def test_the_pool_reports_evictions_and_resets():
    pool, heard = BlockPool(4, 2), Recorder()
    pool.events = heard
    blocks = filled(pool, [1, 2, 3, 4, 5, 6])
    h = block_hashes([1, 2, 3, 4, 5, 6], 2)
    pool.free(blocks[::-1])
    heard.heard.clear()
    pool.allocate(2)  # one free block, then the least recently used cached one: the tail
    assert heard.heard == [("removed", [h[2]])]
    in_use = pool.lookup(h[:1])
    heard.heard.clear()
    pool.reset_prefix_cache()  # h[0] stays findable while in use: not "all cleared"
    assert heard.heard == [("removed", [h[1]])]
    pool.free(in_use)
    heard.heard.clear()
    pool.reset_prefix_cache()
    assert heard.heard == [("cleared",)]


def test_without_a_listener_nothing_is_gathered():
    pool = BlockPool(4, 2)
    blocks = filled(pool, [1, 2, 3, 4])
    pool.report_joined(blocks, block_hashes([1, 2, 3, 4], 2), None, [1, 2, 3, 4])  # a no-op
    assert pool.lookup(block_hashes([1, 2, 3, 4], 2)) == blocks
    assert pool.events is None


def test_a_disabled_prefix_cache_reports_nothing():
    pool, heard = BlockPool(4, 2, enable_prefix_cache=False), Recorder()
    pool.events = heard
    filled(pool, [1, 2, 3, 4])
    assert heard.heard == []


# ---------------------------------------------------------------------- on the wire
@pytest.mark.parametrize("encoding", ["map", "array"])
def test_a_subscriber_decodes_stored_removed_and_cleared_in_vllms_layout(context, encoding):
    config = EngineConfig(kv_events_endpoint=ANY_PORT, kv_events_encoding=encoding)
    pool = BlockPool(3, 2)
    events = attach_kv_events(config, pool)
    try:
        sub = subscriber(context, events.endpoint)
        tokens = [7, 8, 9, 10, 11]
        blocks = filled(pool, tokens)  # no running loop: each report goes out at once
        seq, got = receive(sub, encoding)
        h = block_hashes(tokens, 2)
        assert got == [
            {
                "type": "BlockStored",
                "block_hashes": h,
                "parent_block_hash": None,
                "token_ids": [7, 8, 9, 10],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        ]
        pool.free(blocks[::-1])
        pool.allocate(3)  # evicts both cached blocks, tail first
        pool.reset_prefix_cache()
        seqs = [seq]
        for expected in (
            {"type": "BlockRemoved", "block_hashes": [h[1]], "medium": "GPU"},
            {"type": "BlockRemoved", "block_hashes": [h[0]], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ):
            seq, got = receive(sub, encoding)
            assert got == [expected]
            seqs.append(seq)
        assert seqs == [0, 1, 2, 3]
    finally:
        events.close()


def test_hashes_of_the_top_half_of_uint64_travel_as_unsigned_ints(context):
    pool = BlockPool(2, 1)
    config = EngineConfig(kv_events_endpoint=ANY_PORT, kv_events_encoding="array")
    events = attach_kv_events(config, pool)
    try:
        sub = subscriber(context, events.endpoint)
        offer(pool, pool.allocate(1), [2**64 - 1], 2**63, [5])
        _, got = receive(sub, "array")
        assert got[0]["block_hashes"] == [2**64 - 1] and got[0]["parent_block_hash"] == 2**63
    finally:
        events.close()


def test_one_loop_turns_reports_go_out_as_one_batch(context):
    config = EngineConfig(kv_events_endpoint=ANY_PORT)
    pool = BlockPool(4, 1)
    events = attach_kv_events(config, pool)
    try:
        sub = subscriber(context, events.endpoint)

        async def step() -> None:  # a step's registrations and evictions, in one stretch
            blocks = filled(pool, [1, 2, 3])
            pool.free(blocks[::-1])
            pool.allocate(4)
            await asyncio.sleep(0.05)

        asyncio.run(step())
        h = block_hashes([1, 2, 3], 1)
        seq, got = receive(sub, "map")
        assert seq == 0
        assert [e["type"] for e in got] == ["BlockStored", "BlockRemoved"]
        assert got[1]["block_hashes"] == [h[2], h[1], h[0]]  # three evictions, one event
        assert not sub.poll(100)
    finally:
        events.close()


def test_the_replay_socket_resends_batches_from_a_sequence_number(context):
    config = EngineConfig(kv_events_endpoint=ANY_PORT, kv_events_replay_endpoint=ANY_PORT)
    pool = BlockPool(8, 1)
    events = attach_kv_events(config, pool)
    try:
        for token in range(5):  # five batches, 0..4, that nobody subscribed to
            filled(pool, [token])
        dealer = context.socket(zmq.DEALER)
        dealer.connect(events.replay_endpoint)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "the replay did not end"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            _, batch, _ = msgpack.unpackb(payload)
            replayed.append((int.from_bytes(seq, "big"), batch[0]["token_ids"]))
        assert replayed == [(2, [2]), (3, [3]), (4, [4])]
    finally:
        events.close()


def test_the_topic_frame_lets_a_subscriber_filter(context):
    config = EngineConfig(kv_events_endpoint=ANY_PORT, kv_events_topic="kv@pod-1@tiny")
    pool = BlockPool(2, 1)
    events = attach_kv_events(config, pool)
    try:
        sub = subscriber(context, events.endpoint, b"kv@")
        filled(pool, [3])
        assert sub.poll(5000)
        assert sub.recv_multipart()[0] == b"kv@pod-1@tiny"
    finally:
        events.close()


def test_without_an_endpoint_nothing_is_opened_and_the_pool_has_no_listener():
    pool = BlockPool(2, 1)
    events = attach_kv_events(EngineConfig(), pool)
    assert events is NO_KV_EVENTS and events.endpoint is None
    assert pool.events is None
    events.close()


def test_a_busy_endpoint_is_named():
    first = ZmqPublisher(ANY_PORT)
    busy = first.endpoint.replace("127.0.0.1", "*")  # a wildcard binds (vLLM's rule)
    try:
        with pytest.raises(OSError, match=re.escape(busy)):
            ZmqPublisher(busy)
    finally:
        first.close()


def test_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="kv_events_endpoint"):
        EngineConfig(kv_events_endpoint="localhost:5557")
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
    with pytest.raises(ValueError, match="kv_events_encoding"):
        EngineConfig(kv_events_encoding="json")
