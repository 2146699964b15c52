"""The incremental plan protocol: byte frames round-trip, row state equals full tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.params import SamplingParams
from streams.plan import PLACEHOLDER, NewRow, StepPlan, StepResult, bools, int32s, int64s
from streams.rows import RowState
from streams.wire import decode_plan, decode_result, encode_plan, encode_result


def a_plan() -> StepPlan:
    return StepPlan(
        step_id=41,
        rows=int32s([3, 0, 7]),
        starts=int32s([0, 12, 30]),
        query_lens=int32s([4, 1, 1]),
        sample=bools([True, True, False]),
        input_ids=int64s([5, 6, 7, 8, PLACEHOLDER, 99]),
        new_rows=[NewRow(3, SamplingParams(seed=9), [5, 6, 7, 8], [2])],
        released_rows=int32s([1]),
        reset_rows=int32s([7]),
        new_blocks=int32s([3, 10, 7, 11, 7, 12]),
        requests=["control-plane only"],
    )


def test_a_plan_survives_its_byte_frame():
    plan = a_plan()
    back = decode_plan(encode_plan(plan))
    for name in (
        "rows",
        "starts",
        "query_lens",
        "sample",
        "input_ids",
        "released_rows",
        "reset_rows",
        "new_blocks",
    ):
        assert np.array_equal(getattr(back, name), getattr(plan, name)), name
    assert back.step_id == 41 and back.new_rows == plan.new_rows
    assert back.requests == []  # never sent


def test_a_result_survives_its_byte_frame_with_and_without_extras():
    plain = StepResult(3, np.array([7, 8, 9]), device_start=1.5, device_end=2.25)
    back = decode_result(encode_result(plain))
    assert back.tokens.tolist() == [7, 8, 9] and (back.device_start, back.device_end) == (1.5, 2.25)
    assert back.logprobs is None and back.error is None
    rich = StepResult(4, [1], [-0.5], [[(1, -0.5)]], 0.0, 1.0, error=None)
    back = decode_result(encode_result(rich))
    assert back.logprobs == [-0.5] and back.top_logprobs == [[(1, -0.5)]]
    failed = decode_result(encode_result(StepResult(5, [], error="boom")))
    assert failed.error == "boom" and len(failed.tokens) == 0


def test_row_state_derives_positions_kv_slots_and_tables():
    rows = RowState(block_size=4, max_blocks_per_row=8, rows=2)
    first = StepPlan(
        0,
        int32s([0, 1]),
        int32s([0, 0]),
        int32s([6, 2]),
        bools([True, True]),
        int64s([1, 2, 3, 4, 5, 6, 7, 8]),
        new_rows=[NewRow(0, None, [], []), NewRow(1, None, [], [])],
        new_blocks=int32s([0, 5, 1, 9, 0, 6]),
    )
    rows.apply(first)
    layout = rows.layout(first)
    assert layout.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert layout.kv_slots.tolist() == [20, 21, 22, 23, 24, 25, 36, 37]
    assert layout.context_lens.tolist() == [6, 2]
    assert layout.block_tables.tolist() == [[5, 6], [9, 0]]
    rows.record_sampled(first, np.array([70, 80]))
    decode = StepPlan(
        1,
        int32s([1, 0]),
        int32s([2, 6]),
        int32s([1, 1]),
        bools([True, True]),
        int64s([PLACEHOLDER, PLACEHOLDER]),
    )
    rows.apply(decode)
    layout = rows.layout(decode)
    assert rows.input_ids(decode, layout.token_rows).tolist() == [80, 70]
    assert layout.positions.tolist() == [2, 6] and layout.kv_slots.tolist() == [38, 26]


def test_a_plan_that_reads_past_its_table_is_refused():
    rows = RowState(block_size=4, max_blocks_per_row=8, rows=1)
    plan = StepPlan(
        0,
        int32s([0]),
        int32s([0]),
        int32s([5]),
        bools([True]),
        int64s([1] * 5),
        new_rows=[NewRow(0, None, [], [])],
        new_blocks=int32s([0, 3]),
    )
    rows.apply(plan)
    with pytest.raises(ValueError, match="block table"):
        rows.layout(plan)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1000)), max_size=40),
    st.lists(st.integers(0, 5), max_size=4),
)
def test_appending_blocks_in_any_order_matches_appending_one_by_one(pairs, resets):
    rows = RowState(block_size=4, max_blocks_per_row=64, rows=6)
    naive: dict[int, list[int]] = {r: [] for r in range(6)}
    for row in resets:  # a reset row starts over before the plan's blocks are appended
        naive[row] = []
    plan = StepPlan(
        0,
        int32s([]),
        int32s([]),
        int32s([]),
        bools([]),
        int64s([]),
        reset_rows=int32s(resets),
        new_blocks=int32s([x for pair in pairs for x in pair]),
    )
    rows.apply(plan)
    for row, block in pairs:
        naive[row].append(block)
    assert {r: rows.table(r) for r in range(6)} == naive
