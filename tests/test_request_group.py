"""core.group: the n samples of one submission are queued all or none, stream as one and
are released together (on the simulated device, whose tokens the oracle predicts)."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from async_engine import AsyncEngine, SamplingParams
from async_engine.core.group import RequestOptions, submit
from async_engine.core.inputs import DuplicateRequestError, InputBuilder
from async_engine.core.request import FinishReason
from streams.sim import oracle_tokens

SIM = {"device": "sim", "sim_step_ms": 1, "sim_token_us": 0, "sim_seq_us": 0, "sim_ctx_ns": 0}
PROMPT = [101, 202, 303, 404]
ENDLESS = SamplingParams(max_tokens=5000, ignore_eos=True)


async def until(condition, timeout: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


def idle(engine: AsyncEngine) -> bool:
    stats = engine.stats()
    return stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0


async def test_three_samples_stream_as_one_each_in_order_with_its_own_seed(default_model: Path):
    async with AsyncEngine(model=str(default_model), **SIM) as engine:
        params = SamplingParams(n=3, seed=7, max_tokens=24, ignore_eos=True)
        group = submit(engine, PROMPT, params, "req", RequestOptions(detokenize=False))
        assert group.request_id == "req"
        assert [r.request_id for r in group.children] == ["req#0", "req#1", "req#2"]
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        ended = []
        async for index, delta in group.deltas():
            assert index not in ended, "nothing follows a sample's final delta"
            assert delta.offset == len(tokens[index]), "each sample's output comes in order"
            tokens[index] += delta.token_ids
            if delta.finished:
                assert delta.finish_reason is FinishReason.LENGTH
                ended.append(index)
        assert sorted(ended) == [0, 1, 2]
        mc = engine.model_config
        for i in range(3):
            want = oracle_tokens(PROMPT, 24, 7 + i, mc.vocab_size, tuple(mc.eos_token_ids))
            assert tokens[i] == want, f"sample {i} runs with seed + {i}"
        group.release()
        group.release()  # idempotent
        assert engine.num_streams == 0
        assert await until(lambda: idle(engine))


async def test_one_release_mid_stream_aborts_every_sample_and_frees_their_blocks(
    default_model: Path,
):
    async with AsyncEngine(model=str(default_model), **SIM) as engine:
        params = SamplingParams(n=3, max_tokens=5000, ignore_eos=True)
        group = submit(engine, PROMPT, params, "req", RequestOptions())
        deltas = group.deltas()
        assert (await anext(deltas))[1].token_ids, "generation is under way"
        assert engine.stats().running == 3
        group.release()  # the reader leaves, without even closing its iterator
        assert all(r.finish_reason is FinishReason.ABORTED for r in group.children)
        assert engine.num_streams == 0
        assert await until(lambda: idle(engine)), "every sample's blocks return"
        assert await until(lambda: not readers_of(group)), "nothing reads the samples anymore"
        await deltas.aclose()


def readers_of(group) -> list[asyncio.Task]:
    """Tasks still running a method of ``group``: what reads its samples' streams."""
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done()
        and t.get_coro().cr_frame is not None
        and t.get_coro().cr_frame.f_locals.get("self") is group
    ]


async def test_a_sample_that_cannot_be_queued_takes_back_the_ones_queued_before_it(
    default_model: Path,
):
    async with AsyncEngine(model=str(default_model), **SIM) as engine:
        holder = engine.add_request(PROMPT, ENDLESS, "dup#2")  # sample 2's id is taken
        params = SamplingParams(n=4, max_tokens=5000, ignore_eos=True)
        with pytest.raises(DuplicateRequestError):
            submit(engine, PROMPT, params, "dup", RequestOptions())
        assert engine.num_streams == 1, "only the holder's stream is left"
        for child in ("dup#0", "dup#1"):
            req = engine.scheduler.requests.get(child)
            assert req is None or req.finish_reason is FinishReason.ABORTED
        assert "dup#3" not in engine.scheduler.requests, "nothing past the failed sample"
        engine.release(holder)
        assert await until(lambda: idle(engine))


async def test_abort_ends_every_sample_and_its_reader_still_gets_their_final_deltas(
    default_model: Path,
):
    async with AsyncEngine(model=str(default_model), **SIM) as engine:
        params = SamplingParams(n=2, max_tokens=5000, ignore_eos=True)
        group = submit(engine, PROMPT, params, None, RequestOptions())
        assert len(group.request_id) == 32, "no id given: a fresh one"
        group.abort()
        reasons = {i: d.finish_reason async for i, d in group.deltas() if d.finished}
        assert reasons == {0: FinishReason.ABORTED, 1: FinishReason.ABORTED}
        group.release()
        assert await until(lambda: idle(engine))


def test_every_option_is_one_the_engine_takes():
    taken = {
        *inspect.signature(AsyncEngine.add_request).parameters,
        *inspect.signature(InputBuilder.build).parameters,
    }
    options = RequestOptions().as_kwargs()
    assert set(options) <= taken, set(options) - taken
