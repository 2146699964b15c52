"""The simulated device's runner: the real row bookkeeping, a modelled step time, oracle tokens.

It applies every plan to the same ``RowState`` a model runner keeps (so a protocol bug
shows up here too), computes the oracle's tokens, then waits until the cost model's step
time has passed since the plan arrived. Its busy span is exactly the modelled time.
"""

from __future__ import annotations

import time

import numpy as np

from streams.device import REPLAY_STEP
from streams.plan import PLACEHOLDER, StepPlan, StepResult
from streams.rows import RowState
from streams.sim import CostModel, PreciseClock, request_seed, sim_tokens


class SimRunner:
    def __init__(
        self,
        cost: CostModel,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        block_size: int,
        max_blocks_per_row: int,
    ) -> None:
        self.cost = cost
        self.vocab_size = vocab_size
        self.avoid = np.array(sorted(set(eos_ids)), dtype=np.int64)
        self.block_size = block_size
        self.max_blocks_per_row = max_blocks_per_row
        self.clock = PreciseClock()
        self._busy_until = 0.0  # when the last step's modelled time ends
        self._fresh_rows()

    def _fresh_rows(self) -> None:
        self.rows = RowState(self.block_size, self.max_blocks_per_row)
        self.seeds = np.zeros(len(self.rows.live), dtype=np.int64)

    # Its steps take modelled time: the device loop reads the next plan while one "runs".
    modelled = True

    def run(self, plan: StepPlan, arrived_at: float | None = None) -> StepResult:
        """Run ``plan``. ``arrived_at``: when its bytes came in. Like a GPU behind a host
        thread that decodes plans and encodes results while the device computes, the step
        starts when both it has arrived and the step before has ended: the device loop's
        own work in between is host work, not device time (or idle)."""
        now = time.monotonic()
        start = now if arrived_at is None else min(now, max(arrived_at, self._busy_until))
        try:
            tokens = self._run(plan)
        except Exception as exc:  # the step fails alone; the device keeps serving
            return StepResult(
                plan.step_id,
                [],
                device_start=start,
                device_end=time.monotonic(),
                error=f"{type(exc).__name__}: {exc}",
            )
        # The step ends when the model says; the device process waits for that moment
        # (and reads the next plan meanwhile) before it sends this result.
        self._busy_until = end = start + self.step_seconds(plan)
        return StepResult(plan.step_id, tokens, None, None, start, end)

    def replay(self, plans: list[StepPlan]) -> StepResult:
        live = self.rows, self.seeds
        self._fresh_rows()
        try:
            start = deadline = time.monotonic()
            for plan in plans:
                self._run(plan)
                deadline += self.step_seconds(plan)
            self.clock.wait_until(deadline)
            return StepResult(REPLAY_STEP, [], None, None, start, time.monotonic())
        finally:
            self.rows, self.seeds = live

    def step_seconds(self, plan: StepPlan) -> float:
        context = int(plan.starts.sum()) + int(plan.query_lens.sum())
        return self.cost.seconds(plan.num_tokens, plan.batch_size, context)

    def _run(self, plan: StepPlan) -> np.ndarray:
        self.rows.apply(plan)
        if len(self.seeds) < len(self.rows.live):
            self.seeds = np.resize(self.seeds, len(self.rows.live))
        for new in plan.new_rows:
            self.seeds[new.row] = request_seed(new.params)
        if not len(plan.rows):
            return np.zeros(0, np.int64)
        # Only each row's last input matters here; the full per-token layout is not needed,
        # but the tables must still cover every position the step writes.
        rows, starts, qlens = plan.rows, plan.starts, plan.query_lens
        last_pos = starts.astype(np.int64) + qlens - 1
        if (last_pos // self.block_size >= self.rows.num_blocks[rows]).any():
            raise ValueError("a plan reads past the end of a row's block table")
        sampled = plan.sample
        if not sampled.any():
            return np.zeros(0, np.int64)
        rows = rows[sampled]
        last_ids = plan.input_ids[(np.cumsum(qlens) - 1)[sampled]]
        carried = last_ids == PLACEHOLDER
        if carried.any():
            last_ids = np.where(carried, self.rows.last_tokens[rows], last_ids)
        tokens = sim_tokens(
            last_ids, last_pos[sampled], self.seeds[rows], self.vocab_size, self.avoid
        )
        self.rows.last_tokens[rows] = tokens
        return tokens


def build_sim_runner(
    cost: CostModel,
    vocab_size: int,
    eos_ids: tuple[int, ...],
    block_size: int,
    max_blocks_per_row: int,
) -> SimRunner:
    """Module level, so a device process can receive it by name inside a partial."""
    return SimRunner(cost, vocab_size, eos_ids, block_size, max_blocks_per_row)
