"""How many draft slots a row gets: where extra tokens are nearly free every row gets what
its acceptance warrants; where every token costs (a compute-bound step) none; a row whose
drafts fail gets fewer than one whose drafts hold."""

from __future__ import annotations

import numpy as np
import pytest

from async_engine.core.request import Request
from async_engine.core.row_table import RowTable
from async_engine.core.speculation import Speculation
from async_engine.core.speculation_gate import EXPLORE, MAX_EXPLORE
from async_engine.core.step_times import StepTimes
from sampler.params import SamplingParams
from streams.drafting.config import SpeculativeConfig
from streams.plan import StepPlan, StepResult, int32s, int64s


def table_of(count: int, **params) -> tuple[RowTable, np.ndarray]:
    table = RowTable()
    for row in range(count):
        req = Request(f"r{row}", [1, 2, 3], SamplingParams(**params), max_model_len=64)
        table.attach(req, row)
    return table, np.arange(count, dtype=np.int64)


def times(seconds_by_tokens: dict[int, float]) -> StepTimes:
    clock = StepTimes()
    for tokens, seconds in seconds_by_tokens.items():
        for _ in range(10):
            clock.observe(tokens, seconds)
    return clock


FLAT = {1: 0.010, 8: 0.0101, 64: 0.0105, 512: 0.02}  # a GPU's decode: weights read once
LINEAR = {1: 0.001, 8: 0.008, 64: 0.064, 512: 0.512}  # every token costs alike


def speculation(table: RowTable, clock: StepTimes, k: int = 4, **config) -> Speculation:
    return Speculation(SpeculativeConfig("ngram", num_speculative_tokens=k, **config), table, clock)


def verified(spec: Speculation, rows: list[int], drafted: int, kept: int) -> None:
    n = len(rows)
    plan = StepPlan(
        0,
        int32s(rows),
        int32s([0] * n),
        int32s([1] * n),
        int32s([1 + drafted] * n),
        int64s([0] * n),
    )
    result = StepResult(0, np.zeros(n * (kept + 1), np.int64))
    result.counts = np.full(n, kept + 1, np.int32)
    result.drafted = np.full(n, drafted, np.int32)
    spec.observe(plan, result)


def test_where_extra_tokens_are_nearly_free_every_row_gets_every_slot():
    table, rows = table_of(8)
    assert speculation(table, times(FLAT)).slots(rows, 0).tolist() == [4] * 8


def test_where_every_token_costs_alike_no_row_gets_a_slot():
    table, rows = table_of(8)
    assert speculation(table, times(LINEAR)).slots(rows, 0).tolist() == [0] * 8


def test_a_row_whose_drafts_fail_gets_fewer_slots_than_one_whose_drafts_hold():
    table, rows = table_of(2)
    clock = times({1: 0.010, 2: 0.0105, 4: 0.0115, 8: 0.0135, 16: 0.0175})  # tokens cost some
    spec = speculation(table, clock, k=8)
    for _ in range(6):
        verified(spec, [0], drafted=8, kept=8)
        verified(spec, [1], drafted=8, kept=0)
    good, bad = spec.slots(rows, 0).tolist()
    assert good > bad >= 0


def test_a_row_whose_drafts_failed_still_tries_one_where_slots_are_cheap():
    table, rows = table_of(1)
    spec = speculation(table, times(FLAT))
    for _ in range(20):
        verified(spec, [0], drafted=4, kept=0)
    assert spec.slots(rows, 0).tolist()[0] >= 1


def test_slots_stay_within_the_tokens_no_prompt_wants_the_surest_first():
    table, rows = table_of(3)
    spec = speculation(table, times(FLAT))
    for _ in range(6):
        verified(spec, [0], drafted=4, kept=4)
        verified(spec, [1], drafted=4, kept=2)
        verified(spec, [2], drafted=4, kept=0)
    assert spec.slots(rows, 0).sum() > 6
    assert spec.slots(rows, 0, spare=6).tolist() == [4, 2, 0]


def test_no_slots_where_prompt_tokens_would_fill_the_step():
    table, rows = table_of(4)
    assert speculation(table, times(FLAT)).slots(rows, 0, spare=0).tolist() == [0] * 4


def test_requests_that_opt_out_get_no_slots():
    table, rows = table_of(3, speculate=False)
    assert speculation(table, times(FLAT)).slots(rows, 0).tolist() == [0, 0, 0]


def test_no_slots_in_a_step_with_more_rows_than_disable_by_batch_size():
    table, rows = table_of(5)
    spec = speculation(table, times(FLAT), disable_by_batch_size=4)
    assert spec.slots(rows, 0).tolist() == [0] * 5
    assert spec.slots(rows[:4], 0).tolist() == [4] * 4


def test_without_adaptive_every_row_gets_every_slot():
    table, rows = table_of(4)
    assert speculation(table, times(LINEAR), adaptive=False).slots(rows, 0).tolist() == [4] * 4


def test_observe_counts_drafts_and_accepted_tokens_by_position():
    table, _ = table_of(2)
    spec = speculation(table, times(FLAT))
    verified(spec, [0, 1], drafted=4, kept=2)
    stats = spec.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 8, 4)
    assert stats.accepted_per_position == [2, 2, 0, 0]
    assert stats.acceptance_rate == 0.5 and stats.mean_accepted_length == 3.0


def test_a_verify_steps_extra_device_time_is_beyond_the_same_step_without_drafts():
    table, _ = table_of(8)
    spec = speculation(table, times(LINEAR))  # 1 ms per token
    plan = StepPlan(0, int32s(range(8)), int32s([3] * 8), int32s([4] * 8), int32s([4] * 8),
                    int64s([0] * 32))  # fmt: skip
    result = StepResult(0, np.zeros(16, np.int64), None, None, 1.0, 1.040)  # 40 ms on device
    result.counts = np.full(8, 2, np.int32)
    result.drafted = np.full(8, 3, np.int32)
    spec.observe(plan, result)
    assert spec.stats.verify_device_seconds == pytest.approx(0.040)
    assert spec.stats.verify_extra_device_seconds == pytest.approx(0.040 - 0.008)


def test_slots_are_refused_where_the_gate_measured_speculating_steps_slower():
    table, rows = table_of(4)
    spec = speculation(table, times(FLAT))
    now = 0.0
    for step in range(40):  # the host's drafting makes every verify step 4x longer
        slots = spec.slots(rows, step)
        speculating = bool(slots.any())
        n = len(rows)
        sampled = (1 + slots).astype(np.int32)
        plan = StepPlan(step, int32s(range(n)), int32s([3] * n), sampled, sampled,
                        int64s([0] * int(sampled.sum())))  # fmt: skip
        seconds = 0.040 if speculating else 0.010
        result = StepResult(step, np.zeros(2 * n, np.int64), None, None, now, now + 0.010)
        if speculating:
            result.counts, result.drafted = np.full(n, 2, np.int32), slots.astype(np.int32)
        now += seconds
        spec.observe(plan, result, now)
    assert spec.slots(rows, 0).tolist() == [0] * 4
    assert spec.stats.gated_steps > 0


def test_slots_priced_by_one_slow_step_are_probed_until_the_clock_learns_their_cost():
    table, rows = table_of(1)
    clock = times({1: 0.040, 256: 0.5})  # batch 1 on a CPU: 4 more tokens cost ~1 ms
    clock.observe(2, 0.2)  # but the one 2-token step seen was a new shape's slow first run
    spec = speculation(table, clock)
    granted = []
    for step in range(EXPLORE + 64):
        slots = int(spec.slots(rows, step)[0])
        granted.append(slots)
        clock.observe(1 + slots, 0.040 + 0.00025 * slots)
    assert granted[: EXPLORE - 1] == [0] * (EXPLORE - 1)  # the slow step's price stands...
    assert granted[EXPLORE - 1] == 4  # ...until a probe measures a step with every slot
    assert sum(s == 4 for s in granted[EXPLORE:]) >= 48  # then the slot model grants them


def test_where_slots_cost_what_they_yield_probes_grow_rarer():
    table, rows = table_of(8)
    clock = times(LINEAR)
    spec = speculation(table, clock)
    probes = []
    for step in range(8 * MAX_EXPLORE):
        slots = spec.slots(rows, step)
        if slots.any():
            probes.append(step)
        clock.observe(8 + int(slots.sum()), 0.001 * (8 + int(slots.sum())))
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:3] == [2 * EXPLORE, 4 * EXPLORE, MAX_EXPLORE]
    assert set(gaps[3:]) == {MAX_EXPLORE}


def decoding_scheduler(*waiting_prompts: int, max_seqs: int = 8) -> StepPlan:
    """The next plan of a scheduler whose two requests decode, with requests of
    ``waiting_prompts`` tokens waiting; a 16-token budget, ``max_seqs`` seats."""
    from async_engine.core.policy import make_policy
    from async_engine.core.scheduler import Scheduler, SchedulerConfig
    from blockalloc import BlockPool

    policy = make_policy("fcfs", max_seqs, 16)
    sched = Scheduler(SchedulerConfig(64, 4), BlockPool(64, 4), policy)
    sched.speculation = speculation(sched.table, times(FLAT))
    for i in range(2):
        sched.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(), max_model_len=64))
    prefill = sched.schedule()
    sched.update_from_output(prefill, StepResult(prefill.step_id, np.array([7, 8], np.int64)))
    for i, n in enumerate(waiting_prompts):
        prompt = list(range(1, n + 1))
        sched.add_request(Request(f"w{i}", prompt, SamplingParams(), max_model_len=64))
    return sched.schedule()


def test_decodes_get_draft_slots_from_a_budget_no_prompt_wants():
    plan = decoding_scheduler()
    assert plan.num_sampled.tolist() == [5, 5]  # 1 + 4 drafts each


def test_a_waiting_prompt_that_fills_the_budget_takes_it_before_draft_slots():
    plan = decoding_scheduler(30)
    assert plan.num_sampled[:2].tolist() == [1, 1]
    assert plan.num_tokens == 16  # the rest of the budget went to the prompt


def test_draft_slots_take_what_a_short_waiting_prompt_leaves():
    plan = decoding_scheduler(10)
    assert plan.num_sampled[:2].sum() == 2 + 16 - 2 - 10  # decodes, their drafts, the prompt


def test_with_one_seat_free_only_the_next_waiting_prompt_holds_back_draft_slots():
    plan = decoding_scheduler(10, 10, max_seqs=3)
    assert plan.num_sampled[:2].sum() == 2 + 16 - 2 - 10


def test_with_seats_for_several_waiting_prompts_no_draft_slots_are_granted():
    plan = decoding_scheduler(10, 10)
    assert plan.num_sampled[:2].tolist() == [1, 1]
