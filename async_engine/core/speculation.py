"""How many draft slots each running row gets a step, and what speculation has done so far.

The device drafts and verifies; the control plane only grants slots (``slots``, the
scheduler's ``draft_slots``) and learns from each step's result (``observe``). A slot is
worth granting where the tokens it is expected to add are worth more than the time it adds
to the step: the j-th draft of a row whose drafts are kept with probability a adds a^j
tokens, and it costs the step the time of one more token, which every row of the step
waits for. So a row gets the largest k with a^k above that cost, in tokens:

    cost = (T(n + m) - T(n)) / m * tokens per step / T(n)

where T is the step clock's measured time of a step of n tokens (the batch) and m the slots
granted (found by iterating: the slots change the step's tokens and its yield). On a device
that reads the weights once per step (a GPU, a CPU at small batch) extra tokens are nearly
free and rows get every slot their acceptance warrants; on a compute-bound step (a large
CPU batch) they cost as much as any token and speculation stops for the step. Each row's
acceptance is its own count of kept drafts, shrunk toward the engine-wide rate while it has
few (a Beta prior of ``PRIOR_DRAFTS`` drafts). What the step clock cannot see (the host's
drafting and the verify step's wait for tokens) the gate (core/speculation_gate.py) measures:
it turns slots off for a batch size where speculating steps emit fewer tokens a second. And
where the slot model refuses every slot, the gate probes now and then (every slot granted):
the step clock learns the time of a step of n + m tokens only from such steps, so a price
that rests on one slow step of that size (a new shape's first run on a CPU) would otherwise
stand for good.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from async_engine.core.row_table import SPECULATE, RowTable
from async_engine.core.speculation_gate import SpeculationGate
from async_engine.core.step_times import StepTimes
from streams.drafting.config import SpeculativeConfig
from streams.plan import StepPlan, StepResult

PRIOR_DRAFTS = 8  # how many drafts' worth an even chance weighs in a row's estimate
PRIOR_RATE = 0.5
WINDOW = 64  # past this many drafts a row's counts are halved: old evidence fades


@dataclass(slots=True)
class SpeculationStats:
    """Lifetime counts, vLLM's spec_decode metrics by the same names."""

    num_drafts: int = 0  # row-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # kept at draft index j
    verify_steps: int = 0  # steps that verified drafts
    verify_device_seconds: float = 0.0  # their device time
    # Their device time beyond the step clock's estimate of the same steps without drafts.
    verify_extra_device_seconds: float = 0.0
    gated_steps: int = 0  # steps the slot model gave slots and the gate measured no gain

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying row emitted per step: its kept drafts plus one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculation:
    def __init__(self, config: SpeculativeConfig, table: RowTable, times: StepTimes) -> None:
        self.config = config
        self.table = table
        self.times = times
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.gate = SpeculationGate()

    def slots(self, rows: np.ndarray, step_id: int, spare: int | None = None) -> np.ndarray:
        """Draft slots for each of the running ``rows`` in step ``step_id`` (int64, 0: none).

        ``spare``: the step's tokens no prompt wants (its budget less the decodes' tokens
        and the prompt tokens waiting to be computed; None: no limit). Adaptive slots stay
        within it: past it a draft displaces a prompt token, which the step computes for
        good, for one it keeps only with the draft's acceptance, so it never pays."""
        k, t = self.config.num_speculative_tokens, self.table
        allowed = (t.flags[rows] & SPECULATE) != 0
        limit = self.config.disable_by_batch_size
        if (limit is not None and len(rows) > limit) or not allowed.any():
            return np.zeros(len(rows), np.int64)
        if not self.config.adaptive:
            return np.where(allowed, k, 0)
        if spare is not None and spare <= 0:
            return np.zeros(len(rows), np.int64)
        rates = self._rates(rows)
        rates = np.where(allowed, rates, 0.0)
        slots = self._worth(rates, len(rows))
        if not slots.any():
            if not self.gate.probes(len(rows), step_id):
                return slots
            slots = np.where(allowed, k, 0)
        elif not self.gate.allows(len(rows), step_id):
            self.stats.gated_steps += 1
            return np.zeros(len(rows), np.int64)
        if spare is not None and slots.sum() > spare:
            slots = _most_worth(slots, rates, spare)  # spare > 0: some slot is kept
        return slots

    def _rates(self, rows: np.ndarray) -> np.ndarray:
        """Each row's expected share of drafts kept."""
        t = self.table
        return (t.kept[rows] + PRIOR_DRAFTS * PRIOR_RATE) / (t.drafted[rows] + PRIOR_DRAFTS)

    def _worth(self, rates: np.ndarray, batch: int) -> np.ndarray:
        """The largest k per row whose last slot is worth its cost (see the module's doc)."""
        k = self.config.num_speculative_tokens
        base = self.times.predict(batch)
        if base is None or base <= 0:  # no step measured yet: speculate with the prior
            return np.full(len(rates), k, np.int64)
        slots = np.full(len(rates), k, np.int64)
        rates = np.clip(rates, 1e-6, 1.0 - 1e-6)
        for _ in range(3):  # slots change the step's tokens and its yield: settle them
            extra = int(slots.sum())
            if extra == 0:
                break
            after = self.times.predict(batch + extra) or base
            per_token = max(after - base, 0.0) / extra
            expected = float((rates * (1 - rates**slots) / (1 - rates)).sum())
            cost = per_token * (batch + expected) / after  # in tokens of the step's yield
            if cost <= 0:
                return np.full(len(rates), k, np.int64)
            slots = np.clip(np.floor(np.log(cost) / np.log(rates)), 0, k).astype(np.int64)
        return slots

    def observe(self, plan: StepPlan, result: StepResult, now: float | None = None) -> None:
        """A step's result (arrived at ``now``): the gate's rates, each row's counts of
        verified drafts, and the lifetime stats."""
        self.gate.observe(plan, result, time.monotonic() if now is None else now)
        if not len(result.drafted):
            return
        sampled = plan.num_sampled > 0
        rows = plan.rows[sampled].astype(np.int64)
        drafted = result.drafted.astype(np.int64)
        kept = result.emitted(len(rows)).astype(np.int64) - 1
        t, stats = self.table, self.stats
        t.drafted[rows] += drafted
        t.kept[rows] += kept
        full = rows[t.drafted[rows] > WINDOW]
        if len(full):
            t.drafted[full] //= 2
            t.kept[full] //= 2
        verified = drafted > 0
        stats.num_drafts += int(verified.sum())
        stats.num_draft_tokens += int(drafted.sum())
        stats.num_accepted_tokens += int(kept.sum())
        per_position = stats.accepted_per_position
        for j in range(len(per_position)):
            per_position[j] += int((kept > j).sum())
        seconds = result.device_end - result.device_start
        stats.verify_steps += 1
        stats.verify_device_seconds += seconds
        without = self.times.predict(
            plan.num_tokens - int(np.maximum(plan.num_sampled - 1, 0).sum())
        )
        if without is not None:
            stats.verify_extra_device_seconds += seconds - without


def _most_worth(slots: np.ndarray, rates: np.ndarray, total: int) -> np.ndarray:
    """The ``total`` slots of ``slots`` worth the most tokens (the j-th of a row is worth
    its acceptance to the j-th power, so each row keeps a prefix of its own)."""
    rows = np.repeat(np.arange(len(slots)), slots)
    positions = np.arange(len(rows)) - np.repeat(np.cumsum(slots) - slots, slots) + 1
    kept = np.argsort(-(rates[rows] ** positions), kind="stable")[:total]
    return np.bincount(rows[kept], minlength=len(slots)).astype(np.int64)
