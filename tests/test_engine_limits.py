"""Engine limits: what cannot fit the KV pool or the context, unread output, bad text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from async_engine import LLM, AsyncEngine, SamplingParams
from async_engine.core.request import FinishReason

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompt(n: int, start: int = 100) -> list[int]:
    return [start + (i * 7) % 900 for i in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_model: Path):
    with LLM(str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=256) as llm:
        yield llm


def test_a_request_that_could_outgrow_the_whole_kv_pool_is_refused(tiny_model):
    # 8 blocks of 16 tokens hold 128 tokens; the tiny model's context is longer.
    with LLM(str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=8) as llm:
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate([prompt(10)], SamplingParams(max_tokens=None))
        with pytest.raises(ValueError, match="KV cache"):
            llm.generate([prompt(100)], SamplingParams(max_tokens=40))
        out = llm.generate([prompt(100)], SamplingParams(max_tokens=20, ignore_eos=True))[0]
        assert len(out.token_ids) == 20


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(default_model: Path):
    import time as clock

    with LLM(str(default_model), device="sim", max_model_len=256) as llm:
        huge = "word " * 2_000_000  # 10 MB: tokenizing it would take seconds
        start = clock.perf_counter()
        with pytest.raises(ValueError, match="cannot fit the context"):
            llm.generate([huge], SamplingParams(max_tokens=4))
        assert clock.perf_counter() - start < 1.0
        assert llm.generate(["short"], SamplingParams(max_tokens=2))[0].token_ids


async def test_a_stream_nobody_reads_is_ended_past_its_byte_budget(default_model: Path):
    engine = AsyncEngine(
        model=str(default_model),
        device="sim",
        sim_step_ms=0.2,
        sim_token_us=0,
        sim_seq_us=0,
        sim_ctx_ns=0,
        max_unread_bytes_per_stream=4000,
    )
    try:
        params = SamplingParams(max_tokens=5000, ignore_eos=True, logprobs=5)
        unread = engine.add_request([5, 6, 7], params)  # its reader never comes
        for _ in range(500):
            if unread.finished:
                break
            await asyncio.sleep(0.01)
        assert unread.finish_reason is FinishReason.UNREAD
        assert len(unread.output_ids) < 5000
        final = None
        async for delta in engine.stream(unread):
            final = delta
        assert final is not None and final.finish_reason is FinishReason.UNREAD
        engine.release(unread)
        assert engine.unread.total == 0, "released streams no longer count"
        for _ in range(100):
            if engine.stats().kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().kv_blocks_used == 0
        # A stream that is read keeps going: the budget counts only what waits.
        read = [
            d
            async for d in engine.generate(
                [8, 9], SamplingParams(max_tokens=300, ignore_eos=True, logprobs=5)
            )
        ]
        assert read[-1].finish_reason is FinishReason.LENGTH
    finally:
        await engine.aclose()


async def test_a_long_text_prompt_is_tokenized_off_the_event_loop(default_model: Path):
    engine = AsyncEngine(model=str(default_model), device="sim")
    try:
        text = "word " * 80_000  # ~0.1 s of tokenizing
        gaps: list[float] = []
        loop = asyncio.get_running_loop()

        async def ticker() -> None:
            last = loop.time()
            while True:
                await asyncio.sleep(0.002)
                now = loop.time()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        start = loop.time()
        ids = await engine.prepare(text, None)
        took = loop.time() - start
        tick.cancel()
        assert ids == engine.tokenizer.encode(text)
        assert took > 0.03 and max(gaps) < took / 2, "the loop kept turning meanwhile"
        assert await engine.prepare("short", None) == "short"
        with pytest.raises(ValueError, match="cannot fit"):
            await engine.prepare("x" * 10_000_000, None)
    finally:
        await engine.aclose()


def test_a_prompt_that_is_not_valid_unicode_is_refused_naming_it(llm):
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate("\ud800x", GREEDY)
    with pytest.raises(ValueError, match=r"messages\[0\].content is not valid Unicode"):
        llm.chat([{"role": "user", "content": "a\udfff"}], GREEDY)
