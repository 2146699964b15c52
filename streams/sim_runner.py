"""The simulated device's runner: the real row bookkeeping, a modelled step time, oracle tokens.

It applies every plan to the same ``RowState`` the model runner keeps (so a protocol bug
shows up here too), computes the oracle's token at each sampled position, drafts and
verifies as the model runner on a GPU does (a device drafter over every slot granted, any
other drafter on the host after the step before), then lets the step end when the cost
model says. Its busy span is exactly the modelled time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from streams.device import REPLAY_STEP
from streams.drafting.base import Drafter
from streams.plan import StepPlan, StepResult
from streams.rows import RowState, StepLayout
from streams.sim import CostModel, PreciseClock, request_seed, sim_tokens, text_seed
from streams.sim_text import RepeatingText
from streams.verify import emitted_counts, keep_emitted

# A step that waits for the step before on a GPU: that step's tokens read back (an event
# wait and a small copy) and this one's inputs copied and its graph launched. An estimate
# (tens of microseconds each way), beside the host's own layout and drafting, measured.
HOST_HANDOFF_S = 40e-6


@dataclass(slots=True)
class SimPending:
    """A launched step: its result, which ``finish`` hands over once its modelled end came."""

    step_id: int
    result: StepResult


class SimRunner:
    def __init__(
        self,
        cost: CostModel,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        block_size: int,
        max_blocks_per_row: int,
        drafter: Drafter | None = None,
        repeat: float = 0.0,  # share of positions whose token repeats earlier text
    ) -> None:
        self.cost = cost
        self.vocab_size = vocab_size
        self.avoid = np.array(sorted(set(eos_ids)), dtype=np.int64)
        self.block_size = block_size
        self.max_blocks_per_row = max_blocks_per_row
        self.drafter = drafter
        self.text = RepeatingText(repeat, vocab_size, self.avoid) if repeat > 0 else None
        self.clock = PreciseClock()
        self.info: dict = {}
        self._busy_until = 0.0  # when the last step's modelled time ends
        self._fresh_rows()

    def _fresh_rows(self) -> None:
        self.rows = RowState(self.block_size, self.max_blocks_per_row)
        self.seeds = np.zeros(len(self.rows.live), dtype=np.int64)

    def launch(self, plan: StepPlan, arrived_at: float | None = None) -> SimPending:
        """Run ``plan``'s bookkeeping now; its modelled time runs from ``arrived_at`` (when
        its bytes came in) or the end of the step before, whichever is later. Like a GPU
        behind a host thread that decodes plans and encodes results while the device
        computes, the device loop's own work in between is host work, not device time. A
        step whose drafts are made on the host starts no earlier than the host could have
        made them: after the step before, plus its layout's time and a handoff."""
        now = time.monotonic()
        start = max(now if arrived_at is None else arrived_at, self._busy_until)
        try:
            layout, tokens, counts, turnaround = self._run(plan)
        except Exception as exc:  # the step fails alone; the device keeps serving
            error = f"{type(exc).__name__}: {exc}"
            return SimPending(
                plan.step_id, StepResult(plan.step_id, [], None, None, start, now, error)
            )
        if turnaround is not None:
            start = max(start, self._busy_until + turnaround)
        self._busy_until = end = start + self.step_seconds(layout)
        result = StepResult(plan.step_id, tokens, None, None, start, end)
        if layout.verifying:
            result.counts, result.drafted = counts, layout.drafted
        return SimPending(plan.step_id, result)

    def finish(self, pending: SimPending) -> StepResult:
        """The step's result, once its modelled end has come."""
        self.clock.wait_until(pending.result.device_end)
        return pending.result

    def replay(self, plans: list[StepPlan]) -> StepResult:
        live = self.rows, self.seeds
        self._fresh_rows()
        try:
            start = deadline = time.monotonic()
            for plan in plans:
                layout, *_ = self._run(plan)
                deadline += self.step_seconds(layout)
            self.clock.wait_until(deadline)
            return StepResult(REPLAY_STEP, [], None, None, start, time.monotonic())
        finally:
            self.rows, self.seeds = live

    def step_seconds(self, layout: StepLayout) -> float:
        context = int(layout.context_lens.sum())
        return self.cost.seconds(layout.num_tokens, len(layout.rows), context)

    def _run(self, plan: StepPlan) -> tuple[StepLayout, np.ndarray, np.ndarray, float | None]:
        """The step's layout, sampled tokens and counts, and, for a step that drafts on the
        host, the host's turnaround after the step before ends (None: no wait)."""
        rows = self.rows
        if self.text is not None:
            for row in plan.released_rows.tolist():
                self.text.finished(row)
        rows.apply(plan, self.drafter)
        if len(self.seeds) < len(rows.live):
            self.seeds = np.resize(self.seeds, len(rows.live))
        for new in plan.new_rows:
            self.seeds[new.row] = text_seed(new.prompt_ids, request_seed(new.params))
        # As a model device with its rows' tokens on the device: a drafter that can drafts
        # inside the step, over every slot; any other drafts on the host, which first waits
        # for every step before (its rows' tokens), so the device idles meanwhile.
        drafting = bool((plan.num_sampled > 1).any())
        on_device = drafting and getattr(self.drafter, "drafts_on_device", False)
        # The host's work is timed on this thread's CPU clock: a host thread that has a core
        # to itself (a GPU server's) is neither descheduled nor kept from the GIL by the
        # threads beside it, as this process's may be on a small machine.
        began = time.thread_time()  # the model runner applies the plan before it waits
        layout = rows.layout(plan, self.drafter, every_slot=on_device)
        turnaround = None
        if drafting and not on_device:
            turnaround = time.thread_time() - began + HOST_HANDOFF_S
        at = layout.sample_index
        if not len(at):
            empty = np.zeros(0, np.int64)
            return layout, empty, empty.astype(np.int32), turnaround
        sampled_rows = layout.sample_rows
        if self.text is None:
            # Only the sampled inputs matter here: the oracle's token follows the input there.
            ids = rows.placeholder_tokens(layout)
            seeds = self.seeds[sampled_rows]
            targets = sim_tokens(ids[at], layout.positions[at], seeds, self.vocab_size, self.avoid)
        else:
            targets = self._repeating(layout)
        nsampled = layout.num_sampled[layout.num_sampled > 0]
        if layout.verifying:
            counts = emitted_counts(targets, layout.next_drafts, layout.sample_offsets, nsampled)
            tokens = targets[keep_emitted(layout.sample_offsets, nsampled, counts)]
        else:
            counts, tokens = np.ones(len(nsampled), np.int32), targets
        rows.record(layout, tokens, counts)
        return layout, tokens, counts, turnaround

    def _repeating(self, layout: StepLayout) -> np.ndarray:
        """Each sampled position's token from the text that repeats itself: its context is
        the row's tokens and, for a verified position, the drafts before it."""
        rows, history, length = layout.sample_rows, self.rows.history, self.rows.known
        index, ids = layout.sample_index, layout.input_ids
        drafts = [
            ids[index[s] - offset + 1 : index[s] + 1].tolist()
            for s, offset in enumerate(layout.sample_offsets.tolist())
        ]
        histories = [history[row, : length[row]] for row in rows.tolist()]
        return self.text.tokens(rows, histories, drafts, self.seeds[rows])


def build_sim_runner(
    cost: CostModel,
    vocab_size: int,
    eos_ids: tuple[int, ...],
    block_size: int,
    max_blocks_per_row: int,
    drafter: Callable[[], Drafter] | None = None,
    repeat: float = 0.0,
) -> SimRunner:
    """Module level, so a device process can receive it by name inside a partial (with the
    drafter's factory: the drafter is built in the device process)."""
    made = None if drafter is None else drafter()
    return SimRunner(cost, vocab_size, eos_ids, block_size, max_blocks_per_row, made, repeat)
