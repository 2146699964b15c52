"""Large offline batches: queued while the first steps run, every request's text whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from async_engine import LLM, SamplingParams
from async_engine.core.llm import SUBMIT_BETWEEN_STEPS
from async_engine.core.tokenizer import decode_continuation

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
MANY = 2 * SUBMIT_BETWEEN_STEPS + 5  # queued over several turns of the loop


@pytest.fixture(scope="module")
def llm(tiny_model: Path):
    with LLM(str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=1024) as llm:
        yield llm


def prompt(i: int) -> list[int]:
    return [100 + (i * 13 + k * 7) % 800 for k in range(3 + i % 9)]


def settled(llm: LLM):
    """Stats once the last launched step is done (it may hold blocks a moment longer)."""

    async def settle():
        engine = llm.engine
        while engine.scheduler.ledger.completed_step_id < engine.scheduler.next_step_id - 1:
            await asyncio.sleep(0.005)
        return engine.stats()

    return llm._runner.run(settle())


def test_a_large_batch_comes_back_whole_and_in_input_order(llm):
    outs = llm.generate([prompt(i) for i in range(MANY)], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [prompt(i) for i in range(MANY)]
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in outs)


def test_each_text_is_its_tokens_decoded_after_its_prompt(llm):
    outs = llm.generate([prompt(i) for i in range(MANY)], GREEDY)
    tokenizer = llm.tokenizer
    for out in outs:
        expected = decode_continuation(tokenizer, out.prompt_token_ids, out.token_ids, True)
        assert out.text == expected == out.outputs[0].text


def test_a_bad_prompt_late_in_a_large_batch_fails_the_call_and_frees_every_block(llm):
    prompts = [prompt(i) for i in range(MANY)] + [[1, 2, 10**9]]
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, SamplingParams(max_tokens=200, ignore_eos=True))
    stats = settled(llm)
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert llm.generate([prompt(1)], GREEDY)[0].finish_reason == "length"


def test_bad_items_come_back_as_errors_in_their_places(llm):
    items = [{"prompt": prompt(i)} for i in range(MANY)]
    items[SUBMIT_BETWEEN_STEPS + 1] = {"prompt": []}
    outs = llm.generate_items(items, [GREEDY] * len(items))
    assert isinstance(outs[SUBMIT_BETWEEN_STEPS + 1], ValueError)
    assert sum(isinstance(o, ValueError) for o in outs) == 1
