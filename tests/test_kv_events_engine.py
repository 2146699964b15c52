"""An engine's KV events: a prompt's blocks, their eviction and a reset, as a subscriber
sees them; none of it without an endpoint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq
from kv_subscriber import ANY_PORT, receive, subscriber

from async_engine import LLM, SamplingParams
from async_engine.kv_events import NO_KV_EVENTS
from blockalloc import block_hashes


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


FAST = {"device": "sim", "sim_step_ms": 0.2, "sim_token_us": 0, "sim_seq_us": 0, "sim_ctx_ns": 0}


def test_an_engine_publishes_a_prompts_blocks_their_eviction_and_a_reset(
    default_model: Path, context
):
    options = {"num_kv_blocks": 8, "block_size": 4, "kv_events_endpoint": ANY_PORT}
    with LLM(str(default_model), **FAST, **options) as llm:
        sub = subscriber(context, llm.engine.kv_events.endpoint)
        prompt = list(range(100, 113))  # 13 tokens: 3 full blocks of 4
        llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
        seq, got = receive(sub, "map")
        stored = [e for e in got if e["type"] == "BlockStored"]
        assert stored[0]["parent_block_hash"] is None and stored[0]["block_size"] == 4
        tokens = [t for e in stored for t in e["token_ids"]]
        hashes = [h for e in stored for h in e["block_hashes"]]
        assert tokens[:12] == prompt[:12]
        assert hashes == block_hashes(tokens, 4)  # one chain, each run's parent its last
        # A prompt that needs the whole pool: the first prompt's blocks are evicted.
        llm.generate([list(range(200, 229))], SamplingParams(max_tokens=2, ignore_eos=True))
        removed: list[int] = []
        seqs = [seq]
        while set(hashes[:3]) - set(removed):
            seq, got = receive(sub, "map")
            seqs.append(seq)
            removed += [h for e in got if e["type"] == "BlockRemoved" for h in e["block_hashes"]]

        async def reset() -> None:
            llm.engine.pool.reset_prefix_cache()

        deadline = time.monotonic() + 10  # an ended request's blocks return a step later
        while llm.stats().kv_blocks_free < 8 and time.monotonic() < deadline:
            time.sleep(0.01)

        llm._runner.run(reset())
        got = []
        while {"type": "AllBlocksCleared"} not in got:  # after the second prompt's blocks
            seq, got = receive(sub, "map")
            seqs.append(seq)
        assert got[-1] == {"type": "AllBlocksCleared"}
        assert seqs == list(range(len(seqs)))


def test_an_engine_without_an_endpoint_leaves_its_pool_without_a_listener(default_model: Path):
    with LLM(str(default_model), **FAST) as llm:
        assert llm.engine.kv_events is NO_KV_EVENTS
        assert llm.engine.pool.events is None
