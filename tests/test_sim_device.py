"""The simulated device: oracle outputs under every scheduling path, and its modelled timing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from async_engine import LLM, AsyncEngine, SamplingParams
from streams.drafting.ngram import NgramDrafter
from streams.drafting.suffix import SuffixDrafter
from streams.plan import DRAFT, PLACEHOLDER, NewRow, StepPlan, int32s, int64s
from streams.sim import PRESETS, CostModel, PreciseClock, cost_model, oracle_tokens
from streams.sim_runner import HOST_HANDOFF_S, SimRunner

FAST = {"device": "sim", "sim_step_ms": 0.2, "sim_token_us": 0, "sim_seq_us": 0, "sim_ctx_ns": 0}


def prompts(count: int, lo: int = 5, hi: int = 90, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, rng.integers(lo, hi)).tolist() for _ in range(count)]


def expected(engine: AsyncEngine, prompt: list[int], count: int, seed: int = 0) -> list[int]:
    mc = engine.model_config
    return oracle_tokens(prompt, count, seed, mc.vocab_size, tuple(mc.eos_token_ids))


def check_all(llm: LLM, batch: list[list[int]], params: SamplingParams) -> None:
    outs = llm.generate(batch, params)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == expected(llm.engine, prompt, params.max_tokens)


@pytest.mark.parametrize("overlap", [True, False])
def test_outputs_equal_the_oracle_with_overlap_on_and_off(default_model: Path, overlap: bool):
    with LLM(str(default_model), overlap=overlap, max_num_seqs=32, **FAST) as llm:
        check_all(llm, prompts(40), SamplingParams(max_tokens=24, ignore_eos=True))


def test_outputs_equal_the_oracle_with_chunked_prefill(default_model: Path):
    with LLM(str(default_model), max_num_batched_tokens=24, **FAST) as llm:
        check_all(llm, prompts(12, lo=30, hi=120), SamplingParams(max_tokens=20, ignore_eos=True))


def test_outputs_equal_the_oracle_under_preemption(default_model: Path):
    with LLM(str(default_model), num_kv_blocks=40, block_size=4, **FAST) as llm:
        check_all(llm, prompts(16, lo=10, hi=40), SamplingParams(max_tokens=30, ignore_eos=True))
        assert llm.stats().num_preemptions > 0
        assert llm.stats().kv_blocks_free == 40


def test_n_samples_follow_the_oracle_with_seed_plus_index(default_model: Path):
    with LLM(str(default_model), **FAST) as llm:
        prompt = prompts(1)[0]
        out = llm.generate([prompt], SamplingParams(max_tokens=10, n=3, seed=7))[0]
        got = [sample.token_ids for sample in out.outputs]
        assert got == [expected(llm.engine, prompt, 10, seed=7 + i) for i in range(3)]


def test_seed_changes_the_tokens(default_model: Path):
    with LLM(str(default_model), **FAST) as llm:
        a, b = llm.generate(
            [prompts(1)[0]] * 2, [SamplingParams(max_tokens=8, seed=s) for s in (1, 2)]
        )
        assert a.token_ids != b.token_ids


async def test_an_aborted_stream_is_a_prefix_of_the_oracle_and_frees_its_blocks(
    default_model: Path,
):
    engine = AsyncEngine(model=str(default_model), **FAST)
    try:
        batch = prompts(8)
        params = SamplingParams(max_tokens=200, ignore_eos=True)

        async def run(prompt: list[int], stop_after: int | None) -> list[int]:
            got: list[int] = []
            async for delta in engine.generate(prompt, params):
                assert delta.offset == len(got)
                got += delta.token_ids
                if stop_after is not None and len(got) >= stop_after:
                    break  # leaving the loop aborts the request
            return got

        outs = await asyncio.gather(*(run(p, 5 if i % 2 else None) for i, p in enumerate(batch)))
        for i, (prompt, got) in enumerate(zip(batch, outs, strict=True)):
            assert got == expected(engine, prompt, len(got))
            assert len(got) == 200 or i % 2
        for _ in range(100):
            if engine.stats().kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().kv_blocks_used == 0
    finally:
        await engine.aclose()


def test_the_default_models_config_runs_with_the_named_settings(default_model: Path):
    # The contract outside checks use: these EngineConfig fields and nothing else.
    with LLM(
        model="default", device="sim", sim_step_ms=1.0, sim_token_us=0, sim_seq_us=0, sim_ctx_ns=0
    ) as llm:
        out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4 and isinstance(out.text, str)


def test_the_modelled_step_time_is_met(default_model: Path):
    step_ms = 3.0
    with LLM(
        str(default_model),
        device="sim",
        sim_step_ms=step_ms,
        sim_token_us=0,
        sim_seq_us=0,
        sim_ctx_ns=0,
    ) as llm:
        llm.generate(prompts(4), SamplingParams(max_tokens=30, ignore_eos=True))
        spans = [(end - start) * 1e3 for _, start, end, _ in llm.engine.timeline.spans]
    assert len(spans) >= 30
    # Never shorter than modelled (a sim that skipped its wait), and close on the median.
    assert min(spans) >= step_ms * 0.999
    assert float(np.median(spans)) < step_ms + 0.3


def two_steps(drafter, step_ms: float = 1.0) -> tuple:
    """A prompt that repeats itself, all but its last token computed, then a step of its last
    token and 4 draft slots, launched at once (as the pipeline does) on a device of
    ``step_ms`` a step and 100 us a token; their results."""
    cost = CostModel(step_ms=step_ms, token_us=100.0)
    runner = SimRunner(cost, 50_000, (2,), 16, 8, drafter)
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]
    chunk = StepPlan(
        0, int32s([0]), int32s([0]), int32s([9]), int32s([0]), int64s(prompt[:9]),
        new_rows=[NewRow(0, SamplingParams(), prompt, [])], new_blocks=int32s([0, 0]),
    )  # fmt: skip
    verify = StepPlan(
        1, int32s([0]), int32s([9]), int32s([5]), int32s([5]),
        int64s([prompt[-1], DRAFT, DRAFT, DRAFT, DRAFT]),
    )  # fmt: skip
    first, second = runner.launch(chunk), runner.launch(verify)
    return runner.finish(first), runner.finish(second)


def test_a_device_drafter_verifies_every_slot_inside_a_step_that_follows_at_once():
    # Steps of 50 ms: the second step's layout, on this busy host, ends within the first.
    first, second = two_steps(NgramDrafter(prompt_lookup_min=2, prompt_lookup_max=4), 50.0)
    assert second.device_start == first.device_end  # no wait for the step before's tokens
    assert second.device_end - second.device_start == pytest.approx(50e-3 + 5 * 100e-6)
    assert second.drafted.tolist() == [4]


def test_a_device_drafter_that_finds_nothing_still_pays_for_its_slots():
    first, second = two_steps(NgramDrafter(prompt_lookup_min=7, prompt_lookup_max=7))
    assert second.drafted.tolist() == [0] and second.counts.tolist() == [1]
    assert second.device_end - second.device_start == pytest.approx(1e-3 + 5 * 100e-6)


class DraftsOnTheHost(SuffixDrafter):
    """Suffix decoding that cannot draft ahead (as a draft model drafts: on the host, from
    every token)."""

    drafts_ahead = False


def test_a_host_drafters_step_waits_for_the_step_before_it():
    first, second = two_steps(DraftsOnTheHost(24, 0, 1.0, 0.1))
    assert second.device_start >= first.device_end + HOST_HANDOFF_S
    drafted = int(second.drafted[0])  # only the drafts found are verified
    assert second.device_end - second.device_start == pytest.approx(1e-3 + (1 + drafted) * 1e-4)


def test_cost_model_adds_its_terms():
    cost = CostModel(step_ms=1.0, token_us=2.0, seq_us=3.0, ctx_ns=4.0)
    assert cost.seconds(tokens=10, sequences=5, context_tokens=1000) == pytest.approx(
        1e-3 + 20e-6 + 15e-6 + 4e-6
    )


def test_a_preset_can_be_overridden_term_by_term():
    base = PRESETS["h200-1b"]
    cost = cost_model("h200-1b", step_ms=0.5)
    assert cost.step_ms == 0.5 and cost.token_us == base.token_us


def test_an_unknown_preset_is_refused_by_name():
    with pytest.raises(ValueError, match="sim_preset"):
        cost_model("tpu-9000")
    with pytest.raises(ValueError, match="sim_preset"):
        LLM(model="default", device="sim", sim_preset="tpu-9000")


@pytest.mark.parametrize("field", ["sim_step_ms", "sim_token_us", "sim_seq_us", "sim_ctx_ns"])
def test_a_negative_cost_term_is_refused_by_name(field: str):
    with pytest.raises(ValueError, match=field):
        LLM(model="default", device="sim", **{field: -1.0})


def test_the_precise_clock_waits_at_least_until_the_deadline():
    import time

    clock = PreciseClock()
    for _ in range(20):
        deadline = time.monotonic() + 0.0015
        clock.wait_until(deadline)
        assert time.monotonic() >= deadline


def test_the_oracle_never_produces_an_avoided_id():
    tokens = oracle_tokens([5], 2000, 0, vocab_size=7, avoid=(2, 3))
    assert set(tokens) <= {0, 1, 4, 5, 6} and len(set(tokens)) == 5


async def test_a_lone_stream_at_gpu_speed_gets_every_token_as_it_is_made(default_model: Path):
    """Coalescing (the stream pacer) is for hundreds of readers; a few are woken every step."""
    engine = AsyncEngine(
        model=str(default_model),
        device="sim",
        sim_step_ms=1.0,
        sim_token_us=0,
        sim_seq_us=0,
        sim_ctx_ns=0,
    )
    try:
        for _ in range(3):  # long enough for a pacer that reacts to the loop's jitter
            sizes = [
                len(d.token_ids)
                async for d in engine.generate(
                    [5] * 20, SamplingParams(max_tokens=64, ignore_eos=True)
                )
                if d.token_ids
            ]
            assert sizes == [1] * 64
    finally:
        await engine.aclose()


class Chain:
    """Drafts ahead a fixed chain, and notes the tokens it was shown."""

    drafts_ahead = True

    def __init__(self, chain: list[int]) -> None:
        self.chain, self.shown = chain, []

    def propose(self, rows, tokens, ks):
        self.shown += [len(t) for t in tokens]
        return [np.array(self.chain[:k], np.int64) for k in ks]

    def release(self, row, tokens):
        pass


def sampled_then_verified(drafter) -> tuple:
    """A 10-token prompt computed and its next token sampled, then a step of that token and
    4 draft slots, launched while the first runs (1 ms a step, 100 us a token); their
    results."""
    runner = SimRunner(CostModel(step_ms=1.0, token_us=100.0), 50_000, (2,), 16, 8, drafter)
    prompt = list(range(20, 30))
    prefill = StepPlan(
        0, int32s([0]), int32s([0]), int32s([10]), int32s([1]), int64s(prompt),
        new_rows=[NewRow(0, SamplingParams(), prompt, [])], new_blocks=int32s([0, 0]),
    )  # fmt: skip
    verify = StepPlan(
        1, int32s([0]), int32s([10]), int32s([5]), int32s([5]),
        int64s([PLACEHOLDER, DRAFT, DRAFT, DRAFT, DRAFT]),
    )  # fmt: skip
    first = runner.launch(prefill)
    second = runner.launch(verify)
    return runner.finish(first), runner.finish(second)


def first_token() -> int:
    """The oracle's token after the prompt of ``sampled_then_verified``."""
    first, _ = sampled_then_verified(Chain([]))
    return int(first.tokens[0])


def test_a_drafter_that_drafts_ahead_keeps_its_chain_past_the_token_it_foresaw():
    drafter = Chain([first_token(), 5, 6, 7, 8, 9])
    first, second = sampled_then_verified(drafter)
    assert drafter.shown == [10]  # the prompt alone: the first step's token was not back
    assert second.device_start == pytest.approx(first.device_end, abs=2e-4)  # no wait
    assert second.drafted.tolist() == [4]
    assert second.device_end - second.device_start == pytest.approx(1e-3 + 5 * 100e-6)


def test_a_drafter_that_drafts_ahead_and_foresaw_wrongly_verifies_nothing_but_pays_its_slots():
    first, second = sampled_then_verified(Chain([first_token() + 1, 5, 6, 7, 8, 9]))
    assert second.drafted.tolist() == [0] and second.counts.tolist() == [1]
    assert second.device_end - second.device_start == pytest.approx(1e-3 + 5 * 100e-6)
