"""Speculation where it pays in practice: per batch size, the gate compares the token rate
of steps that speculated with that of steps that did not (host work included, which the
step clock cannot see) and keeps the faster mode, trying the other now and then."""

from __future__ import annotations

import numpy as np

from async_engine.core.speculation_gate import EXPLORE, SpeculationGate
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

    def step(self, prefill: bool = False) -> None:
        """One step; a prefilling one also computes 20 prompt tokens a row."""
        speculate = self.gate.allows(self.rows)
        self.speculated += speculate
        n = self.rows
        sampled = [1 + 3 * speculate] * n
        query = [q + 20 * prefill for q in sampled]
        plan = StepPlan(0, int32s(range(n)), int32s([5] * n), int32s(query), int32s(sampled),
                        int64s([0] * sum(query)))  # fmt: skip
        emitted = self.spec_tokens if speculate else 1
        seconds = self.spec_s if speculate else self.plain_s
        result = StepResult(0, np.zeros(n * emitted, np.int64), None, None, self.now,
                            self.now + seconds)  # fmt: skip
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


def test_where_speculating_steps_emit_fewer_tokens_a_second_the_gate_turns_them_off():
    gate = SpeculationGate()
    work = Workload(gate, rows=16, plain_s=0.010, spec_s=0.040, spec_tokens=2)  # 50 vs 100/s
    work.run(40)  # learning
    speculated = work.run(10 * EXPLORE)
    assert speculated == 10  # one exploring step in every EXPLORE


def test_where_speculating_pays_the_gate_keeps_it_on_but_for_exploring_steps():
    gate = SpeculationGate()
    work = Workload(gate, rows=1, plain_s=0.010, spec_s=0.012, spec_tokens=3)  # 250 vs 100/s
    work.run(40)
    assert work.run(10 * EXPLORE) == 10 * EXPLORE - 10


def test_batch_sizes_learn_apart():
    gate = SpeculationGate()
    small = Workload(gate, rows=2, plain_s=0.010, spec_s=0.012, spec_tokens=3)
    large = Workload(gate, rows=32, plain_s=0.010, spec_s=0.040, spec_tokens=2)
    for _ in range(60):
        small.step()
        large.now = small.now
        large.step()
        small.now = large.now
    assert gate.allows(2) and not gate.allows(32)


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


def _mixed_step(gate: SpeculationGate, now: float, speculate: bool, prompt: int) -> float:
    """Four decoding rows (three drafts each, all kept, when speculating) beside a prompt
    chunk of ``prompt`` tokens, 10 ms a step; the time after it."""
    sampled = [4 if speculate else 1] * 4
    plan = StepPlan(0, int32s(range(5)), int32s([5] * 5), int32s([*sampled, prompt]),
                    int32s([*sampled, 0]), int64s([0] * (sum(sampled) + prompt)))  # fmt: skip
    result = StepResult(0, np.zeros(sum(sampled), np.int64), None, None, now, now + 0.010)
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
