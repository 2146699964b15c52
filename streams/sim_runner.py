"""The simulated device's runner: the real row bookkeeping, a modelled step time, oracle tokens.

It applies every plan to the same ``RowState`` the model runner keeps (so a protocol bug
shows up here too), computes the oracle's token at each sampled position, drafts and
verifies as the model runner on a GPU does (a device drafter over every slot granted; a
drafter that drafts ahead on the host, over the step in flight, its drafts kept over every
slot where they follow the tokens that step emitted; any other drafter on the host after
the step before), then lets the step end when the cost model says. Its busy span is exactly
the modelled time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from streams.device import REPLAY_STEP
from streams.drafting.ahead import KeptChains
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
        self.emitted = np.zeros(len(self.rows.live), dtype=np.int64)  # by the last step, by row

    def launch(self, plan: StepPlan, arrived_at: float | None = None) -> SimPending:
        """Run ``plan``'s bookkeeping now; its modelled time runs from ``arrived_at`` (when
        its bytes came in) or the end of the step before, whichever is later. Like a GPU
        behind a host thread that decodes plans and encodes results while the device
        computes, the device loop's own work in between is host work, not device time. A
        step whose drafts are made on the host starts no earlier than the host could have
        made them: after the step before, plus its layout's time and a handoff. Any other
        starts no earlier than its layout was made; a drafter that drafts ahead then has not
        seen the tokens of the step before if that step was still running."""
        now = time.monotonic()
        start = max(now if arrived_at is None else arrived_at, self._busy_until)
        try:
            layout, tokens, counts, host, waits = self._run(plan, now < self._busy_until)
        except Exception as exc:  # the step fails alone; the device keeps serving
            error = f"{type(exc).__name__}: {exc}"
            return SimPending(
                plan.step_id, StepResult(plan.step_id, [], None, None, start, now, error)
            )
        if waits:
            start = max(start, self._busy_until + host + HOST_HANDOFF_S)
        else:
            start = max(start, now + host)
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
                layout, *_ = self._run(plan, in_flight=False)
                deadline += self.step_seconds(layout)
            self.clock.wait_until(deadline)
            return StepResult(REPLAY_STEP, [], None, None, start, time.monotonic())
        finally:
            self.rows, self.seeds = live

    def step_seconds(self, layout: StepLayout) -> float:
        context = int(layout.context_lens.sum())
        return self.cost.seconds(layout.num_tokens, len(layout.rows), context)

    def _run(
        self, plan: StepPlan, in_flight: bool
    ) -> tuple[StepLayout, np.ndarray, np.ndarray, float, bool]:
        """The step's layout, sampled tokens and counts, the host's time laying it out, and
        whether the host waited for the step before (``in_flight``: it was still running)."""
        rows = self.rows
        if self.text is not None:
            for row in plan.released_rows.tolist():
                self.text.finished(row)
        rows.apply(plan, self.drafter)
        if len(self.seeds) < len(rows.live):
            self.seeds = np.resize(self.seeds, len(rows.live))
        if len(self.emitted) < len(rows.live):
            self.emitted = np.resize(self.emitted, len(rows.live))
        for new in plan.new_rows:
            self.seeds[new.row] = text_seed(new.prompt_ids, request_seed(new.params))
            self.emitted[new.row] = 0
        # As a model device with its rows' tokens on the device: a drafter that can drafts
        # inside the step, over every slot; one that drafts ahead drafts on the host over the
        # step in flight, and the device keeps its drafts over every slot; any other drafts
        # on the host, which first waits for every step before, so the device idles meanwhile.
        drafting = bool((plan.num_sampled > 1).any())
        on_device = drafting and getattr(self.drafter, "drafts_on_device", False)
        ahead = drafting and not on_device and getattr(self.drafter, "drafts_ahead", False)
        # The host's work is timed on this thread's CPU clock: a host thread that has a core
        # to itself (a GPU server's) is neither descheduled nor kept from the GIL by the
        # threads beside it, as this process's may be on a small machine.
        began = time.thread_time()  # the model runner applies the plan before it waits
        if ahead:  # the host's chains, then the device's part (its time is the step's)
            unseen = self.emitted if in_flight else None
            chains = rows.layout(plan, self.drafter, drafts_on_device=True, unseen=unseen)
            host = time.thread_time() - began
            kept = KeptChains(chains.chains, chains.rows[chains.num_sampled > 1],
                              getattr(self.drafter, "missed", None))  # fmt: skip
            layout = rows.layout(plan, kept, every_slot=True)
        else:
            layout = rows.layout(plan, self.drafter, every_slot=on_device)
            host = time.thread_time() - began
        waits = drafting and not (on_device or ahead)
        self.emitted[:] = 0  # this step's, from here on
        at = layout.sample_index
        if not len(at):
            empty = np.zeros(0, np.int64)
            return layout, empty, empty.astype(np.int32), host, waits
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
        self.emitted[layout.rows[layout.num_sampled > 0]] = counts
        return layout, tokens, counts, host, waits

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
