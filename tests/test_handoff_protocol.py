"""The incremental plan protocol: byte frames round-trip, row state equals full tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.params import SamplingParams
from streams.drafting.ahead import KeptChains
from streams.plan import DRAFT, PLACEHOLDER, RESOLVE, NewRow, StepPlan, StepResult, int32s, int64s
from streams.rows import RowState, StepLayout
from streams.verify import emitted_counts, keep_emitted
from streams.wire import decode_plan, decode_result, encode_plan, encode_result


def a_plan() -> StepPlan:
    return StepPlan(
        step_id=41,
        rows=int32s([3, 0, 7]),
        starts=int32s([0, 12, 30]),
        query_lens=int32s([4, 1, 1]),
        num_sampled=int32s([1, 1, 0]),
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
        "num_sampled",
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
    runs = StepResult(6, np.array([4, 5, 6, 7]), counts=int32s([3, 1]), drafted=int32s([4, 0]))
    back = decode_result(encode_result(runs))
    assert back.counts.tolist() == [3, 1] and back.drafted.tolist() == [4, 0]
    assert back.emitted(2).tolist() == [3, 1] and plain.emitted(3).tolist() == [1, 1, 1]


def test_row_state_derives_positions_kv_slots_and_tables():
    rows = RowState(block_size=4, max_blocks_per_row=8, rows=2)
    first = StepPlan(
        0,
        int32s([0, 1]),
        int32s([0, 0]),
        int32s([6, 2]),
        int32s([1, 1]),
        int64s([1, 2, 3, 4, 5, 6, 7, 8]),
        new_rows=[NewRow(0, None, [1, 2, 3, 4, 5, 6], []), NewRow(1, None, [7, 8], [])],
        new_blocks=int32s([0, 5, 1, 9, 0, 6]),
    )
    rows.apply(first)
    layout = rows.layout(first)
    assert layout.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert layout.kv_slots.tolist() == [20, 21, 22, 23, 24, 25, 36, 37]
    assert layout.context_lens.tolist() == [6, 2] and layout.width == 2
    assert rows.table(0) == [5, 6] and rows.table(1) == [9]
    assert layout.sample_index.tolist() == [5, 7]
    rows.record(layout, np.array([70, 80]), int32s([1, 1]))
    decode = StepPlan(
        1,
        int32s([1, 0]),
        int32s([2, 6]),
        int32s([1, 1]),
        int32s([1, 1]),
        int64s([PLACEHOLDER, PLACEHOLDER]),
    )
    rows.apply(decode)
    layout = rows.layout(decode)
    assert rows.placeholder_tokens(layout).tolist() == [80, 70]
    assert layout.positions.tolist() == [2, 6] and layout.kv_slots.tolist() == [38, 26]
    assert rows.length.tolist()[:2] == [7, 3]


class Fixed:
    """A drafter that proposes the same tokens for every row (and records what it saw)."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts, self.seen, self.released = np.array(drafts, np.int64), [], []

    def propose(self, rows, tokens, ks):
        self.seen += [(r, t.tolist(), k) for r, t, k in zip(rows, tokens, ks, strict=True)]
        return [self.drafts[:k] for k in ks]

    def release(self, row, tokens):
        self.released.append((row, tokens.tolist()))


def verifying_row() -> tuple[RowState, StepPlan]:
    """Row 0 holds 5 tokens; the plan verifies up to 3 drafts after its last."""
    rows = RowState(block_size=4, max_blocks_per_row=8, rows=1)
    prompt = [1, 2, 3, 4, 5]
    rows.apply(
        StepPlan(
            0, int32s([]), int32s([]), int32s([]), int32s([]), int64s([]),
            new_rows=[NewRow(0, None, prompt, [])], new_blocks=int32s([0, 3, 0, 6]),
        )
    )  # fmt: skip
    plan = StepPlan(
        1,
        int32s([0]),
        int32s([RESOLVE]),
        int32s([4]),
        int32s([4]),
        int64s([PLACEHOLDER, DRAFT, DRAFT, DRAFT]),
    )
    return rows, plan


def test_a_resolved_start_begins_at_the_rows_last_token_and_drafts_fill_its_slots():
    rows, plan = verifying_row()
    layout = rows.layout(plan, Fixed([6, 7, 8, 9]))
    assert layout.starts.tolist() == [4] and layout.positions.tolist() == [4, 5, 6, 7]
    assert layout.input_ids.tolist() == [PLACEHOLDER, 6, 7, 8]
    assert layout.sample_offsets.tolist() == [0, 1, 2, 3]
    assert layout.next_drafts.tolist() == [6, 7, 8, -1]
    assert layout.drafted.tolist() == [3] and layout.verifying


def test_slots_the_drafter_leaves_empty_are_dropped():
    rows, plan = verifying_row()
    layout = rows.layout(plan, Fixed([6]))
    assert layout.query_lens.tolist() == [2] and layout.num_sampled.tolist() == [2]
    assert layout.input_ids.tolist() == [PLACEHOLDER, 6] and layout.drafted.tolist() == [1]
    nothing = rows.layout(plan, Fixed([]))
    assert nothing.query_lens.tolist() == [1] and not nothing.verifying


def test_device_drafts_fill_every_slot_and_end_the_run_where_they_end():
    """The simulated device's twin of a device drafter: every slot is verified, the ones
    past the drafts found hold a filler no sampled token can match."""
    rows, plan = verifying_row()
    layout = rows.layout(plan, Fixed([6]), every_slot=True)
    assert layout.input_ids.tolist() == [PLACEHOLDER, 6, 0, 0] and layout.num_tokens == 4
    assert layout.drafted.tolist() == [1] and layout.next_drafts.tolist() == [6, -1, -1, -1]
    sampled = np.array([6, 0, 0, 0])  # a filler equal to the sampled token ends it all the same
    counts = emitted_counts(sampled, layout.next_drafts, layout.sample_offsets, int32s([4]))
    assert counts.tolist() == [2]


def test_device_slots_with_no_draft_found_are_still_verified():
    rows, plan = verifying_row()
    layout = rows.layout(plan, Fixed([]), every_slot=True)
    assert layout.num_tokens == 4 and layout.drafted.tolist() == [0] and layout.verifying
    assert layout.next_drafts.tolist() == [-1, -1, -1, -1]


class Ahead(Fixed):
    """``Fixed``, drafting ahead: its proposal is a chain past the tokens it was shown."""

    drafts_ahead = True
    missed = None


class Lookup:
    """A fallback drafter that proposes the same tokens (and records what it saw)."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts, self.seen = np.array(drafts, np.int64), []

    def lookup(self, tokens, k):
        self.seen.append(tokens.tolist())
        return self.drafts[:k]


def drafted_ahead(drafter: Ahead, missed=None) -> StepLayout:
    """The simulated device's step: the row's last two tokens were the step in flight's, so
    the host drafts from the three before; the device keeps what its chain foresaw."""
    rows, plan = verifying_row()
    host = rows.layout(plan, drafter, drafts_on_device=True, unseen=np.array([2]))
    kept = KeptChains(host.chains, host.rows, missed)
    return rows.layout(plan, kept, every_slot=True)


def test_a_chain_drafted_ahead_is_kept_past_the_tokens_its_drafter_did_not_see():
    drafter = Ahead([4, 5, 6, 7, 8])
    layout = drafted_ahead(drafter)
    assert drafter.seen == [(0, [1, 2, 3], 5)]  # two to foresee, three slots
    assert layout.input_ids.tolist() == [PLACEHOLDER, 6, 7, 8] and layout.drafted.tolist() == [3]


def test_a_chain_that_foresaw_wrongly_leaves_the_row_without_drafts():
    layout = drafted_ahead(Ahead([4, 9, 6, 7, 8]))
    assert layout.input_ids.tolist() == [PLACEHOLDER, 0, 0, 0] and layout.drafted.tolist() == [0]


def test_a_chain_that_foresaw_wrongly_leaves_the_row_to_the_fallback_drafter():
    missed = Lookup([6])
    layout = drafted_ahead(Ahead([4, 9, 6, 7, 8]), missed)
    assert missed.seen == [[1, 2, 3, 4, 5]]  # every token: it runs on the device
    assert layout.input_ids.tolist() == [PLACEHOLDER, 6, 0, 0] and layout.drafted.tolist() == [1]


def test_chains_for_the_device_run_past_what_the_steps_in_flight_may_emit():
    """A verify step of 3 slots in flight: the row holds 1 to 4 tokens more than the host
    has, so the next step's chain is 4 + 3 long, from the 5 tokens the host has."""
    rows, plan = verifying_row()
    rows.grow(rows.layout(plan, drafts_on_device=True))
    rows.append_blocks(np.array([0]), np.array([7]))  # room for the next step
    drafter = Ahead([])
    layout = rows.layout(plan, drafter, drafts_on_device=True)
    assert drafter.seen == [(0, [1, 2, 3, 4, 5], 7)]
    assert layout.input_ids.tolist()[1:] == [DRAFT] * 3 and layout.resolve_on_device.all()
    assert layout.chains.base.tolist() == [5] and layout.chains.lengths.tolist() == [0]


def test_the_drafter_sees_the_rows_tokens_so_far():
    rows, plan = verifying_row()
    drafter = Fixed([])
    rows.layout(plan, drafter)
    assert drafter.seen == [(0, [1, 2, 3, 4, 5], 3)]


def test_a_released_rows_tokens_go_to_the_drafter():
    rows, plan = verifying_row()
    drafter = Fixed([6, 7, 8])
    rows.record(rows.layout(plan, drafter), np.array([6, 7, 11]), int32s([3]))
    release = StepPlan(2, *(int32s([]),) * 4, int64s([]), released_rows=int32s([0]))
    rows.apply(release, drafter)
    assert drafter.released == [(0, [1, 2, 3, 4, 5, 6, 7, 11])]


def test_draft_slots_without_a_drafter_are_refused():
    rows, plan = verifying_row()
    with pytest.raises(ValueError, match="drafter"):
        rows.layout(plan)


def test_a_verified_run_grows_the_row_and_its_history():
    rows, plan = verifying_row()
    layout = rows.layout(plan, Fixed([6, 7, 8]))
    rows.record(layout, np.array([6, 7, 11]), int32s([3]))
    assert rows.length[0] == 8 and rows.history[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 11]


def test_a_row_whose_verify_step_is_in_flight_is_laid_out_for_the_device_to_move():
    """Launched, a verify step's row holds at least one token more; a step after it, laid
    out before its count comes back, starts there and is flagged for the device (which
    knows the count); the count settles the row and its tokens join its history."""
    rows, plan = verifying_row()
    layout = rows.layout(plan, drafts_on_device=True)
    assert layout.drafts_on_device and layout.input_ids.tolist()[1:] == [DRAFT] * 3
    rows.grow(layout)  # counts decided on the device
    assert rows.length[0] == 6 and rows.unsettled[0] == 1
    after = StepPlan(2, int32s([0]), int32s([RESOLVE]), int32s([1]), int32s([1]),
                     int64s([PLACEHOLDER]))  # fmt: skip
    moved = rows.layout(after)
    assert moved.starts.tolist() == [5] and moved.resolve_on_device.tolist() == [True]
    rows.settle(layout, int32s([3]), rows.joined(layout))
    rows.remember(layout, int32s([3]), np.array([6, 7, 11]))
    assert rows.length[0] == 8 and rows.unsettled[0] == 0
    assert rows.history[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 11]
    assert rows.layout(after).resolve_on_device is None and rows.layout(after).starts[0] == 7


def test_a_row_taken_by_another_request_ignores_the_last_ones_late_counts():
    rows, plan = verifying_row()
    layout = rows.layout(plan, drafts_on_device=True)
    rows.grow(layout)
    joined = rows.joined(layout)
    rows.apply(StepPlan(2, *(int32s([]),) * 4, int64s([]), released_rows=int32s([0]),
                        new_rows=[NewRow(0, None, [9, 9], [])]))  # fmt: skip
    rows.settle(layout, int32s([3]), joined)
    rows.remember(layout, int32s([3]), np.array([6, 7, 11]), joined)
    assert rows.length[0] == 2 and rows.unsettled[0] == 0
    assert rows.known[0] == 2 and rows.history[0, :2].tolist() == [9, 9]


def test_a_row_emits_its_longest_run_that_equals_the_drafts_plus_one():
    #   row 0: 3 drafts, sampled [6, 7, 9, 4] against drafts [6, 7, 8]: 6, 7 kept, 9 replaces 8
    #   row 1: no drafts; row 2: 2 drafts, the first wrong
    tokens = np.array([6, 7, 9, 4, 50, 1, 2, 3])
    drafts = np.array([6, 7, 8, -1, -1, 5, 2, -1])
    offsets = np.array([0, 1, 2, 3, 0, 0, 1, 2])
    runs = np.array([4, 1, 3])
    counts = emitted_counts(tokens, drafts, offsets, runs)
    assert counts.tolist() == [3, 1, 1]
    assert tokens[keep_emitted(offsets, runs, counts)].tolist() == [6, 7, 9, 50, 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=6),
       st.data())  # fmt: skip
def test_the_device_decides_the_same_runs_as_the_host(runs, data):
    """The rule in torch ops of fixed shapes (a model device's) against the numpy twin (the
    simulated device's): per row its sampled tokens and the drafts after them."""
    import torch

    from streams.verify import counts_of_runs, kept_of_runs

    tokens = np.array([t for run in runs for t in run], np.int64)
    drafts = np.array(
        [d for run in runs for d in [*data.draw(st.lists(st.integers(0, 3), min_size=len(run)
                                    - 1, max_size=len(run) - 1)), -1]], np.int64
    )  # fmt: skip
    offsets = np.concatenate([np.arange(len(run)) for run in runs])
    sizes = np.array([len(run) for run in runs])
    want = emitted_counts(tokens, drafts, offsets, sizes)
    index = torch.from_numpy(np.repeat(np.arange(len(runs)), sizes))
    t = [torch.from_numpy(x) for x in (tokens, drafts, offsets)]
    got = counts_of_runs(*t, index, len(runs))
    assert got.tolist() == want.tolist()
    kept = kept_of_runs(t[2], index, got).numpy()
    assert kept.tolist() == keep_emitted(offsets, sizes, want).tolist()


def test_a_plan_that_reads_past_its_table_is_refused():
    rows = RowState(block_size=4, max_blocks_per_row=8, rows=1)
    plan = StepPlan(
        0,
        int32s([0]),
        int32s([0]),
        int32s([5]),
        int32s([1]),
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
        int32s([]),
        int64s([]),
        reset_rows=int32s(resets),
        new_blocks=int32s([x for pair in pairs for x in pair]),
    )
    rows.apply(plan)
    for row, block in pairs:
        naive[row].append(block)
    assert {r: rows.table(r) for r in range(6)} == naive
