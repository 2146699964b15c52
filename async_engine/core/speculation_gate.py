"""Whether speculating pays in practice, per batch size: the measured token rate of steps
that speculated against that of steps that did not.

The slot model (core/speculation.py) prices a draft by the step clock's device time. What it
cannot see is the host's share of a verify step: drafting, the verify layout, and the wait
for the previous step's tokens that drafting needs (a verify step is launched only once its
rows' tokens are known). Where those cost more than the kept drafts save (many rows on a
fast device, or a CPU whose host and device share the cores) the gate turns speculation off
for that batch size, whatever the slot model grants.

It learns from when results arrive: the time from one result to the next is a step's whole
cost, host work and waits included, in either loop. Each batch size class (the decoding
rows' bit length: 1, 2-3, 4-7, ...) keeps, for each mode, what its steps were worth (below)
a decoding row and the seconds they took, both fading (``FADE`` a step), and rates the mode by their ratio.
The mode not in favour is tried now and then (every ``LEARN_EVERY``-th step until both have
``MIN_SAMPLES``), so a change in acceptance or load is seen: first after ``EXPLORE`` steps,
then after twice as many as the last time, up to ``MAX_EXPLORE``; a try that beats the
favoured mode brings them back to every ``EXPLORE``, so a few tries close together can turn
the favour.
A try costs what the losing mode loses a step (a verify step that waits for its tokens can
cost two plain ones on a fast device), so a fixed one in 16 would cost a few per cent for
good; backing off keeps it under one. Steps the slot model granted no slots are probed on
the same schedule (``probes``): its price of a slot may rest on a step size measured once.

Only the steps the gate decided are rated: those the slot model granted slots, so that
either mode could run them. A step with no choice (prompt tokens filled its budget, or no
row's drafts were worth a slot) is often of another kind altogether (a prefill chunk beside
a few decodes, hundreds of tokens a decoding row), and rating it as "plain" would compare
prefill with decoding, not the two modes.

A step's worth is the tokens it finished for good: those its rows emitted and the prompt
tokens it computed. Both are work every request needs done once (drafts that were refused
are not), so the mode that finishes more of it a second serves more requests a second.
Steps that prefill beside decoding rows count too (where prompts arrive all the time, agent
loops, most steps do), and prompt tokens must: draft slots share the step's token budget
with prompt chunks, so a verify step that emits more tokens a row may leave prompts waiting
longer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streams.plan import StepPlan, StepResult

EXPLORE = 16
MAX_EXPLORE = 128
LEARN_EVERY = 4
MIN_SAMPLES = 3
FADE = 0.9  # the weight a mode's past steps keep at each new one
STALE_SECONDS = 1.0  # a gap longer than this (and than 20 device spans) was idleness


@dataclass(slots=True)
class ModeRate:
    tokens: float = 0.0  # emitted and prompt tokens computed, a decoding row, fading
    seconds: float = 0.0
    samples: int = 0

    def add(self, tokens_a_row: float, seconds: float) -> None:
        self.samples += 1
        self.tokens = self.tokens * FADE + tokens_a_row
        self.seconds = self.seconds * FADE + seconds

    @property
    def tokens_per_second(self) -> float:
        """A row's, over the mode's recent steps."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class Backoff:
    """Every ``every``-th call is due; each due call doubles ``every``, up to ``MAX_EXPLORE``."""

    every: int = EXPLORE
    since: int = 0

    def due(self) -> bool:
        self.since += 1
        if self.since < self.every:
            return False
        self.since = 0
        self.every = min(2 * self.every, MAX_EXPLORE)
        return True

    def reset(self) -> None:
        self.every, self.since = EXPLORE, 0


@dataclass(slots=True)
class BatchClass:
    speculating: ModeRate
    plain: ModeRate
    decisions: int = 0
    tries: Backoff = field(default_factory=Backoff)  # of the mode not in favour
    probes: Backoff = field(default_factory=Backoff)  # of slots the slot model refused

    def favours_speculation(self) -> bool:
        return self.speculating.tokens_per_second >= self.plain.tokens_per_second

    def learning(self) -> bool:
        """Whether either mode has too few steps measured to be rated."""
        return min(self.speculating.samples, self.plain.samples) < MIN_SAMPLES

    def add(self, speculating: bool, tokens_a_row: float, seconds: float) -> None:
        """A step's measure; a try of the mode not in favour that beat the favoured mode's
        rate brings tries back to every ``EXPLORE`` steps (one fast step rarely turns the
        fading rates at once; a few close together do)."""
        mode, other = (
            (self.speculating, self.plain) if speculating else (self.plain, self.speculating)
        )
        if not self.learning() and self.favours_speculation() != speculating:
            if tokens_a_row / seconds > other.tokens_per_second:
                self.tries.reset()
        mode.add(tokens_a_row, seconds)


class SpeculationGate:
    def __init__(self) -> None:
        self.classes: dict[int, BatchClass] = {}
        self._last_arrival: float | None = None
        self._decided: dict[int, bool] = {}  # step id -> whether it speculates, until observed
        self.turned_off_steps = 0  # steps the slot model granted slots and the gate refused

    def allows(self, num_rows: int, step_id: int) -> bool:
        """Whether step ``step_id``, of ``num_rows`` decoding rows that the slot model would
        give draft slots, should speculate."""
        cls = self._class(num_rows)
        cls.probes.reset()
        allow = self._decide(cls)
        self._decided[step_id] = allow
        return allow

    def probes(self, num_rows: int, step_id: int) -> bool:
        """Whether step ``step_id``, of ``num_rows`` decoding rows that the slot model gave no
        slots, should speculate all the same (why: core/speculation.py); on the tries'
        schedule, rated like any speculating step."""
        if not self._class(num_rows).probes.due():
            return False
        self._decided[step_id] = True
        return True

    def _decide(self, cls: BatchClass) -> bool:
        cls.decisions += 1
        if cls.learning():
            # Speculate first (its rate is the unknown that matters), then try plain.
            allow = cls.decisions % LEARN_EVERY != 0
        else:
            favoured = cls.favours_speculation()
            allow = favoured != cls.tries.due()
        if not allow:
            self.turned_off_steps += 1
        return allow

    def observe(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """A step's result arrived at ``now``: if the gate decided the step, its period rates
        the mode it ran in."""
        last, self._last_arrival = self._last_arrival, now
        speculating = self._decided.pop(plan.step_id, None)
        if self._decided and min(self._decided) < plan.step_id:  # steps that never ran
            self._decided = {s: d for s, d in self._decided.items() if s > plan.step_id}
        # Decoding rows feed only sampled tokens (one, or one and its drafts).
        decoding = int(((plan.num_sampled > 0) & (plan.query_lens == plan.num_sampled)).sum())
        if last is None or speculating is None or not decoding or result.error is not None:
            return
        period = now - last
        span = result.device_end - result.device_start
        if period <= 0 or (period > STALE_SECONDS and period > 20 * span):
            return
        emitted = int(result.emitted(int((plan.num_sampled > 0).sum())).sum())
        prompts = plan.query_lens > plan.num_sampled  # rows computing prompt tokens
        prompt_tokens = int(plan.query_lens[prompts].sum())
        self._class(decoding).add(speculating, (emitted + prompt_tokens) / decoding, period)

    def _class(self, num_rows: int) -> BatchClass:
        key = max(num_rows, 1).bit_length()
        cls = self.classes.get(key)
        if cls is None:
            cls = self.classes[key] = BatchClass(ModeRate(), ModeRate())
        return cls

    def summary(self) -> dict[int, tuple[float, float]]:
        """Per class (its smallest batch size): (speculating, plain) tokens a second a row."""
        return {
            1 << (key - 1): (c.speculating.tokens_per_second, c.plain.tokens_per_second)
            for key, c in sorted(self.classes.items())
        }
