"""Engine behaviour on a tiny random Llama: sampling, aborts, prefix cache, stops, failures."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from faults import fail_on

from async_engine import LLM, AsyncEngine, SamplingParams
from async_engine.core.engine import EngineClosedError
from async_engine.core.request import FinishReason

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model: Path):
    with LLM(str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=256) as llm:
        yield llm


def prompt(n: int, start: int = 100) -> list[int]:
    return [start + (i * 7) % 900 for i in range(n)]


def test_results_come_back_in_input_order(llm):
    prompts = [prompt(n, start=s) for n, s in ((40, 100), (3, 500), (17, 900))]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert together == alone


def test_seeded_sampling_is_the_same_whatever_else_is_in_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt(20)], seeded)[0].token_ids
    batch = [prompt(5, 300), prompt(20), prompt(33, 700)]
    mixed = llm.generate(batch, [others, seeded, others])[1].token_ids
    assert mixed == alone


def test_different_seeds_give_different_tokens(llm):
    outs = llm.generate(
        [prompt(20), prompt(20)],
        [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 2)],
    )
    assert outs[0].token_ids != outs[1].token_ids


def test_max_tokens_ends_with_length(llm):
    out = llm.generate([prompt(8)], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(out[0].token_ids) == 5 and out[0].finish_reason == "length"


def test_stop_token_id_ends_with_stop_and_counts_the_wasted_token(llm, monkeypatch):
    # Pin the overlap loop's mode: always plan step N+1 before step N's tokens are applied
    # (on a CPU it may otherwise wait for a step that ends in time, which wastes nothing).
    monkeypatch.setattr(llm.engine.clock, "planning", "overlap")
    free = llm.generate([prompt(9)], GREEDY)[0].token_ids
    stop_at = free[3]
    before = llm.stats().wasted_tokens
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at])
    out = llm.generate([prompt(9)], params)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == free[: free.index(stop_at) + 1]
    # Under overlap the next step was already launched for it: its token is dropped, counted.
    assert _settled(llm).wasted_tokens == before + 1


def test_min_tokens_holds_back_a_stop_token(llm):
    free = llm.generate([prompt(9)], GREEDY)[0].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, stop_token_ids=[free[0]])
    out = llm.generate([prompt(9)], params)[0]
    assert len(out.token_ids) == 12 and free[0] not in out.token_ids


def test_stop_string_is_cut_from_the_text(llm):
    free = llm.generate([prompt(9)], GREEDY)[0]
    stop = free.text[4:7]
    if not stop.strip():
        pytest.skip("the tiny model produced blank text here")
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])
    out = llm.generate([prompt(9)], params)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    kept = llm.generate(
        [prompt(9)],
        SamplingParams(
            temperature=0.0, max_tokens=12, stop=[stop], include_stop_str_in_output=True
        ),
    )[0]
    assert kept.text == out.text + stop


def test_a_repeated_long_prefix_is_served_from_the_cache(llm):
    shared = prompt(100, 200)
    first = llm.generate([shared + [11, 12]], GREEDY)[0]
    second = llm.generate([shared + [11, 12]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96  # six full 16-token blocks
    assert second.token_ids == first.token_ids


def test_all_blocks_return_to_the_pool_after_requests_end(llm):
    llm.generate([prompt(50), prompt(70, 300)], GREEDY)
    stats = _settled(llm)
    assert stats.kv_blocks_free == stats.kv_blocks_total


def _settled(llm):
    # The last launched step may still hold blocks for a moment after the final token.
    async def settle():
        engine = llm.engine
        while engine.scheduler.ledger.completed_step_id < engine.scheduler.next_step_id - 1:
            await asyncio.sleep(0.005)
        return engine.stats()

    return llm._runner.run(settle())


BAD_PARAMS = [
    ("max_tokens", dict(max_tokens=0)),
    ("min_tokens", dict(min_tokens=5, max_tokens=2)),
    ("temperature", dict(temperature=-1.0)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=1.5)),
    ("presence_penalty", dict(presence_penalty=float("inf"))),
    ("frequency_penalty", dict(frequency_penalty=float("nan"))),
    ("repetition_penalty", dict(repetition_penalty=float("nan"))),
    ("n", dict(n=0)),
    ("stop", dict(stop=[""])),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD_PARAMS, ids=[f for f, _ in BAD_PARAMS])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("bad_prompt", "field"),
    [([], "prompt"), ("", "prompt"), ([1, 2, 10**9], "prompt"), ([-1], "prompt")],
    ids=["empty-ids", "empty-text", "id-past-vocab", "negative-id"],
)
def test_bad_prompts_name_the_field_and_the_engine_keeps_serving(llm, bad_prompt, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([bad_prompt], GREEDY)
    assert llm.generate([prompt(4)], GREEDY)[0].finish_reason == "length"


def test_prompt_plus_max_tokens_over_the_context_is_refused_or_truncated(llm):
    limit = llm.engine.max_model_len
    too_long = prompt(limit - 4)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([too_long], SamplingParams(max_tokens=10))
    out = llm.generate(
        [too_long], SamplingParams(max_tokens=10, ignore_eos=True), truncate_prompt=True
    )[0]
    assert len(out.prompt_token_ids) == limit - 10 and len(out.token_ids) == 10


def test_a_failing_step_fails_only_its_requests(tiny_model):
    poison = 777
    failing = fail_on(poison)  # the fault lives in a test-only wrapper, not in the runtime
    with LLM(str(tiny_model), dtype="float32", device="cpu", device_wrapper=failing) as llm:
        outs = llm.generate([prompt(6), [poison, 5, 6]], GREEDY)
        # Both shared the failing prefill step; a request arriving after it is served.
        assert [o.finish_reason for o in outs] == ["error", "error"]
        assert llm.generate([prompt(6)], GREEDY)[0].finish_reason == "length"


async def test_abort_ends_the_stream_and_frees_blocks_within_one_step(tiny_model):
    engine = AsyncEngine(model=str(tiny_model), dtype="float32", device="cpu")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        received, reasons, aborted_at = 0, [], None
        async for delta in engine.generate(prompt(40), params, request_id="victim"):
            received += len(delta.token_ids)
            if received >= 3 and aborted_at is None:
                aborted_at = engine.scheduler.next_step_id - 1  # newest launched step
                assert await engine.abort("victim")
            if delta.finished:
                reasons.append(delta.finish_reason)
        assert reasons == [FinishReason.ABORTED]
        while engine.scheduler.ledger.completed_step_id < aborted_at:
            await asyncio.sleep(0.002)
        # Blocks are back once the step in flight at the abort has completed.
        assert engine.pool.num_free == engine.pool.num_blocks
        assert not await engine.abort("victim")  # finished: harmless
        assert not await engine.abort("never-existed")
    finally:
        await engine.aclose()


async def test_a_consumer_that_stops_reading_aborts_its_request(tiny_model):
    engine = AsyncEngine(model=str(tiny_model), dtype="float32", device="cpu")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        gen = engine.generate(prompt(10), params, request_id="leaver")
        async for _ in gen:
            break
        await gen.aclose()
        assert engine.scheduler.requests.get("leaver") is None or (
            engine.scheduler.requests["leaver"].finish_reason is FinishReason.ABORTED
        )
        while engine.scheduler.requests:
            await asyncio.sleep(0.002)
        assert engine.pool.num_free == engine.pool.num_blocks
    finally:
        await engine.aclose()


def test_overlap_on_and_off_give_identical_seeded_outputs(tiny_model):
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=10, ignore_eos=True) for s in range(4)
    ]
    prompts = [prompt(n, 100 + n) for n in (3, 30, 47, 64)]
    results = []
    for overlap in (True, False):
        with LLM(str(tiny_model), dtype="float32", device="cpu", overlap=overlap) as llm:
            results.append([o.token_ids for o in llm.generate(prompts, params)])
    assert results[0] == results[1]


def test_n_samples_come_back_together_each_with_its_own_seed(llm):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt(12)], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert out.token_ids == out.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    # Sample i is what a single request with seed 7 + i gives.
    single = llm.generate(
        [prompt(12)], SamplingParams(temperature=1.0, seed=8, max_tokens=8, ignore_eos=True)
    )[0]
    assert out.outputs[1].token_ids == single.token_ids


def test_a_prompt_longer_than_the_token_budget_is_chunked_with_the_same_output(tiny_model):
    prompts = [prompt(90), prompt(7, 400)]
    results = []
    for budget in (16, 512):
        with LLM(
            str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=budget
        ) as llm:
            results.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
    assert results[0] == results[1]


async def test_an_id_is_reusable_once_its_aborted_request_has_left(tiny_model):
    from async_engine.core.inputs import DuplicateRequestError

    engine = AsyncEngine(model=str(tiny_model), dtype="float32", device="cpu")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        req = engine.add_request(prompt(10), params, "same")
        async for delta in engine.stream(req):
            if not delta.finished:
                await engine.abort("same")
        engine.release(req)
        if "same" in engine.scheduler.requests:  # its last launched step is still running
            with pytest.raises(DuplicateRequestError):
                engine.add_request(prompt(10), params, "same")
        while "same" in engine.scheduler.requests:
            await asyncio.sleep(0.002)
        again = engine.add_request(prompt(10), params, "same")
        tokens = [t async for d in engine.stream(again) for t in d.token_ids]
        engine.release(again)
        assert len(tokens) == 50
    finally:
        await engine.aclose()


async def test_a_killed_model_device_is_replaced_and_serves_the_same_tokens(tiny_model):
    engine = AsyncEngine(model=str(tiny_model), dtype="float32", device="cpu")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        before = [t async for d in engine.generate(prompt(10), params) for t in d.token_ids]
        reasons = []
        async for delta in engine.generate(prompt(10), params):
            if delta.offset == 0 and delta.token_ids:
                os.kill(engine.device.pid, signal.SIGKILL)
            if delta.finished:
                reasons.append(delta.finish_reason)
        assert reasons == [FinishReason.DEVICE_LOST]  # its reader had seen output
        after = [t async for d in engine.generate(prompt(10), params) for t in d.token_ids]
        assert after == before
        assert engine.stats().device_restarts == 1
    finally:
        await engine.aclose()


def test_offline_text_equals_the_streamed_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    offline = llm.generate([prompt(9)], params)[0]

    async def streamed():
        return "".join([d.text async for d in llm.engine.generate(prompt(9), params)])

    assert llm._runner.run(streamed()) == offline.text
    assert offline.text


async def test_async_with_closes_the_engine_and_its_device(tiny_model):
    async with AsyncEngine(
        model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=64
    ) as engine:
        out = [d async for d in engine.generate([5, 6, 7], GREEDY)]
        assert out[-1].finished
        device = engine.device
    assert not device.alive()
    with pytest.raises(EngineClosedError):
        engine.add_request([5, 6, 7], GREEDY)
