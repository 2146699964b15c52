"""Speculation where it pays in practice: per batch size, the gate compares the token rate
of steps that speculated with that of steps that did not (host work included, which the
step clock cannot see) and keeps the faster mode, trying the other now and then."""

from __future__ import annotations

import numpy as np

from async_engine.core.speculation_gate import EXPLORE, MAX_EXPLORE, SpeculationGate
from streams.plan import StepPlan, StepResult, int32s, int64s


class Workload:
    """Decode steps of ``rows`` rows on a fake clock: a plain step takes ``plain_s`` and
    emits a token a row, a speculating one takes ``spec_s`` and emits ``spec_tokens``."""

    def __init__(self, gate: SpeculationGate, rows: int, plain_s: float, spec_s: float,
                 spec_tokens: int) -> None:  # fmt: skip
        self.gate, self.rows = gate, rows
        self.plain_s, self.spec_s, self.spec_tokens = plain_s, spec_s, spec_tokens
        self.now = 100.0
        self.speculated = 0
        self.step_id = 0

    def step(self, prefill: bool = False) -> None:
        """One step; a prefilling one also computes a prompt chunk of 20 tokens a row."""
        self.step_id += 1
        speculate = self.gate.allows(self.rows, self.step_id)
        self.speculated += speculate
        n = self.rows
        sampled = [1 + 3 * speculate] * n
        query = [*sampled, 20 * n] if prefill else sampled
        sampled = [*sampled, 0] if prefill else sampled
        plan = StepPlan(self.step_id, int32s(range(len(query))), int32s([5] * len(query)),
                        int32s(query), int32s(sampled), int64s([0] * sum(query)))  # fmt: skip
        emitted = self.spec_tokens if speculate else 1
        seconds = self.spec_s if speculate else self.plain_s
        result = StepResult(self.step_id, np.zeros(n * emitted, np.int64), None, None,
                            self.now, self.now + seconds)  # fmt: skip
        if speculate:
            result.counts = np.full(n, emitted, np.int32)
            result.drafted = np.full(n, 3, np.int32)
        self.now += seconds
        self.gate.observe(plan, result, self.now)

    def run(self, steps: int) -> int:
        """How many of the steps speculated."""
        before = self.speculated
        for _ in range(steps):
            self.step()
        return self.speculated - before

    def gaps(self, steps: int, mode: bool) -> list[int]:
        """Over the next ``steps``, the steps from one step in ``mode`` (speculating or not)
        to the next."""
        at = []
        for i in range(steps):
            before = self.speculated
            self.step()
            if (self.speculated > before) == mode:
                at.append(i)
        return [b - a for a, b in zip(at, at[1:], strict=False)]


def test_where_speculating_steps_emit_fewer_tokens_a_second_the_gate_turns_them_off():
    gate = SpeculationGate()
    work = Workload(gate, rows=16, plain_s=0.010, spec_s=0.040, spec_tokens=2)  # 50 vs 100/s
    work.run(40)  # learning
    assert work.run(4 * MAX_EXPLORE) <= 8  # only the tries of the mode not in favour


def test_where_speculating_pays_the_gate_keeps_it_on_but_for_exploring_steps():
    gate = SpeculationGate()
    work = Workload(gate, rows=1, plain_s=0.010, spec_s=0.012, spec_tokens=3)  # 250 vs 100/s
    work.run(40)
    assert work.run(4 * MAX_EXPLORE) >= 4 * MAX_EXPLORE - 8


def test_tries_that_confirm_the_favour_grow_rarer_up_to_a_limit():
    gate = SpeculationGate()
    work = Workload(gate, rows=16, plain_s=0.010, spec_s=0.040, spec_tokens=2)
    work.run(40)
    gaps = work.gaps(8 * MAX_EXPLORE, mode=True)
    assert all(b in (2 * a, MAX_EXPLORE) for a, b in zip(gaps, gaps[1:], strict=False))
    assert gaps[-1] == MAX_EXPLORE


def test_a_try_that_beats_the_favoured_mode_brings_tries_back_to_every_explore_steps():
    gate = SpeculationGate()
    work = Workload(gate, rows=16, plain_s=0.010, spec_s=0.040, spec_tokens=2)
    work.run(40 + 8 * MAX_EXPLORE)  # plain in favour, tries every MAX_EXPLORE
    work.spec_s = 0.011  # now speculating pays: 182 vs 100 tokens a second
    work.run(MAX_EXPLORE + 1)  # a try has seen it
    assert work.gaps(4 * EXPLORE, mode=True)[0] == EXPLORE


def test_tries_that_keep_beating_the_favoured_mode_turn_the_favour():
    gate = SpeculationGate()
    work = Workload(gate, rows=16, plain_s=0.010, spec_s=0.040, spec_tokens=2)
    work.run(40 + 8 * MAX_EXPLORE)
    work.spec_s = 0.011
    work.run(3 * MAX_EXPLORE)
    assert gate.classes[5].favours_speculation()


def test_batch_sizes_learn_apart():
    gate = SpeculationGate()
    small = Workload(gate, rows=2, plain_s=0.010, spec_s=0.012, spec_tokens=3)
    large = Workload(gate, rows=32, plain_s=0.010, spec_s=0.040, spec_tokens=2)
    for _ in range(60):
        small.step()
        large.now = small.now
        large.step()
        small.now = large.now
    assert gate.allows(2, 1000) and not gate.allows(32, 1001)


def test_steps_that_also_prefill_are_measured_as_their_mode():
    gate = SpeculationGate()
    work = Workload(gate, rows=4, plain_s=0.010, spec_s=0.040, spec_tokens=2)
    for _ in range(40):
        work.step(prefill=True)  # prompts arrive all the time (agent loops)
    cls = gate.classes[3]
    assert cls.plain.samples > 0 and cls.speculating.samples > 0
    assert not cls.favours_speculation()


def test_the_first_step_after_an_idle_gap_is_not_measured():
    gate = SpeculationGate()
    work = Workload(gate, rows=4, plain_s=0.010, spec_s=0.010, spec_tokens=2)
    work.step()
    work.step()  # measured: the first has no step before it
    work.now += 30.0  # nothing ran for 30 s
    work.step()
    cls = gate.classes[3]
    assert cls.plain.samples + cls.speculating.samples == 1


def _mixed_step(
    gate: SpeculationGate, now: float, speculate: bool, prompt: int, decided: bool = True
) -> float:
    """Four decoding rows (three drafts each, all kept, when speculating) beside a prompt
    chunk of ``prompt`` tokens, 10 ms a step, the mode the gate's (``decided``) or the
    step's own; the time after it."""
    step = round(now * 1000)
    if decided:
        gate._decided[step] = speculate  # as ``allows`` left it, whatever it would decide
    sampled = [4 if speculate else 1] * 4
    plan = StepPlan(step, int32s(range(5)), int32s([5] * 5), int32s([*sampled, prompt]),
                    int32s([*sampled, 0]), int64s([0] * (sum(sampled) + prompt)))  # fmt: skip
    result = StepResult(step, np.zeros(sum(sampled), np.int64), None, None, now, now + 0.010)
    if speculate:
        result.counts, result.drafted = np.full(4, 4, np.int32), np.full(4, 3, np.int32)
    gate.observe(plan, result, now + 0.010)
    return now + 0.010


def test_prompt_tokens_a_verify_step_displaces_are_charged_to_it():
    """The token budget a verify step's drafts take is the prompts': 16 tokens emitted and
    100 prompt tokens a step against 4 emitted and 400 prompt tokens in the same time."""
    gate, now = SpeculationGate(), 100.0
    for _ in range(8):
        now = _mixed_step(gate, now, speculate=True, prompt=100)
        now = _mixed_step(gate, now, speculate=False, prompt=400)
    assert not gate.classes[3].favours_speculation()


def test_a_step_of_prompts_alone_is_not_measured():
    """A prompt's last chunk samples its first token but had nothing to draft from: such a
    step made no choice between the modes."""
    gate, now = SpeculationGate(), 100.0
    now = _mixed_step(gate, now, speculate=False, prompt=0)  # the first has no step before it
    plan = StepPlan(7, int32s([7]), int32s([0]), int32s([300]), int32s([1]), int64s([0] * 300))
    gate.observe(
        plan, StepResult(7, np.zeros(1, np.int64), None, None, now, now + 0.01), now + 0.01
    )
    assert gate.classes == {}


def test_a_step_the_gate_did_not_decide_is_not_measured():
    """A step that decoded beside a prompt chunk filling its budget had no slots to grant:
    its hundreds of prompt tokens a decoding row say nothing about speculating."""
    gate, now = SpeculationGate(), 100.0
    now = _mixed_step(gate, now, speculate=False, prompt=0)
    for _ in range(8):
        now = _mixed_step(gate, now, speculate=False, prompt=400, decided=False)
    assert gate.classes == {}


def test_each_step_is_rated_in_the_mode_the_gate_decided_for_it():
    gate, now = SpeculationGate(), 100.0
    now = _mixed_step(gate, now, speculate=False, prompt=0)
    for _ in range(4):
        now = _mixed_step(gate, now, speculate=True, prompt=0)
    now = _mixed_step(gate, now, speculate=False, prompt=0)
    cls = gate.classes[3]
    assert (cls.speculating.samples, cls.plain.samples) == (4, 1)


def test_steps_the_slot_model_refused_are_probed_on_the_try_schedule():
    gate = SpeculationGate()
    due = [step for step in range(1, 4 * EXPLORE) if gate.probes(8, step)]
    assert due == [EXPLORE, 3 * EXPLORE]  # after 16 refused steps, then 32 more


def test_probes_start_over_once_the_slot_model_grants_slots_again():
    gate = SpeculationGate()
    for step in range(1, 4 * EXPLORE):
        gate.probes(8, step)  # probes every 16, then 32 refused steps
    gate.allows(8, 100)
    assert [step for step in range(200, 200 + EXPLORE) if gate.probes(8, step)] == [
        200 + EXPLORE - 1
    ]
