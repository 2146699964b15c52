"""Plans one step at a time: which requests run, how many tokens each, which KV blocks.

No prefill/decode phases: every request's ``num_computed_tokens`` catches up with its
token count under a per-step token budget, so chunked prefill and mixed batches need no
special case. The budget goes to running decodes first (each with the draft slots the
speculation policy grants it), then to prompt chunks, then to admissions. The policy
(``core/policy``) holds the waiting requests and decides their order, the victims of
preemption, the service counted and each step's shape; the scheduler asks it and plans.
The running requests' counters live in the row table (``core/row_table.py``), so decodes
are chosen, planned and applied over arrays. Blocks of a request that ends or is
preempted return to the pool only once every launched step that uses them has completed
(``core/ledger.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from async_engine.core.bulk_decodes import plan_decodes
from async_engine.core.device_loss import settle_device_loss
from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.ledger import ReleaseLedger
from async_engine.core.plan_builder import PlanPart, build_plan, chosen_part
from async_engine.core.policy import Policy, StepShape
from async_engine.core.preemption import Preemption
from async_engine.core.request import FinishReason, Request, RequestStatus
from async_engine.core.row_chooser import RowChooser
from async_engine.core.row_table import RowTable
from async_engine.core.running import Running
from async_engine.core.speculation import Speculation
from async_engine.core.step_clock import StepClock
from async_engine.core.step_results import apply_step, record_prompt_scores
from async_engine.core.step_times import StepTimes
from blockalloc import BlockPool
from streams.drafting.config import SpeculativeConfig
from streams.plan import NewRow, StepPlan, StepResult


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int
    block_size: int
    speculative: SpeculativeConfig | None = None  # draft slots for decodes (speculation)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        policy: Policy,
        clock: StepClock | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.table = RowTable()
        self.kv = KVCacheManager(pool, config.block_size, self.table)
        self.requests: dict[str, Request] = {}
        self.running = Running()
        self.ledger = ReleaseLedger(self.kv, self.requests, self.table)
        self.preemption = Preemption(self.running, policy, self.kv, self.ledger)
        self._make_room = self.preemption.make_room
        self.rows = RowChooser(
            config.block_size, policy, self.kv, self.running, self.ledger, self._make_room
        )
        # Speculative decoding, where the engine is configured for it: the draft slots each
        # running row gets (core/speculation.py), from the step clock's step times.
        self.speculation: Speculation | None = None
        if config.speculative is not None:
            times = clock.step_times if clock is not None else StepTimes()
            self.speculation = Speculation(config.speculative, self.table, times)
        self.next_step_id = 0
        self.wasted_tokens = 0
        self._ended: list[Request] = []  # since take_ended
        # Every token of a step costs the device about the same (a CPU), unlike a GPU that
        # reads the weights once for a whole batch: the engine sets it from its step clock.
        self.compute_bound = False

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        if req.token_limit > self.config.max_model_len:
            raise ValueError(f"request {req.request_id!r} was built for a longer context")
        self.requests[req.request_id] = req
        self.policy.add(req)

    @property
    def num_waiting(self) -> int:
        return self.policy.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self.policy.num_waiting)

    # ------------------------------------------------------------------ plans
    def schedule(self) -> StepPlan | None:
        step_id, running = self.next_step_id, self.running
        shape = self.policy.step_shape(step_id, running, self.compute_bound)
        if shape.first_tokens:
            plan = self._first_token_step(shape)
            if plan is not None:
                return plan  # else nobody could be admitted into it: an ordinary step
            shape = self.policy.step_shape(
                step_id, running, self.compute_bound, allow_first_tokens=False
            )
        if self.policy.num_waiting:
            self.register_filled()  # an admission looks its prefix up: it must find them
        parts, new_rows = self._plan_step(shape)
        if not parts:
            return None  # released rows ride along with the next real plan
        return self._plan(parts, new_rows)

    def _plan_step(self, shape: StepShape) -> tuple[list[PlanPart], list[NewRow]]:
        """The running decodes, then prompt chunks and admissions in the budget left; only
        a step short of blocks for its decodes plans them one by one, and may preempt."""
        step_id, parts = self.next_step_id, []
        chosen: list[tuple[Request, int]] = []
        new_rows: list[NewRow] = []
        preemptions_before = self.preemption.count
        running = self.running
        slots = self.speculation.slots if self.speculation is not None else None
        waiting = self._waiting_tokens(shape) if slots is not None else 0
        bulk = plan_decodes(
            self.kv, self.policy, running, running.rows(), shape.budget, slots, step_id, waiting
        )
        if bulk is not None:
            part, chunks, budget = bulk
            if part is not None:
                parts.append(part)
        else:
            budget, chunks = self.rows.decodes(list(self.running), chosen, shape.budget, True)
        # A request the policy puts in first-token steps goes before the prompt chunks here
        # too: one that arrived while a first-token step ran does not wait for the next.
        if chunks and self.preemption.count == preemptions_before:
            budget = self.rows.admit(chosen, new_rows, budget, shape, first_tokens=True)
        budget = self._chunks(chunks, chosen, budget)
        # Admit nothing in a step that had to preempt: the pool is short already.
        if self.preemption.count == preemptions_before:
            self.rows.admit(chosen, new_rows, budget, shape, first_tokens=False)
        # A victim may have been chosen before it was preempted (when every request was).
        chosen = [(r, n) for r, n in chosen if r.status is RequestStatus.RUNNING]
        if chosen:
            parts.append(chosen_part(chosen, self.table, step_id))
        return parts, new_rows

    def _waiting_tokens(self, shape: StepShape) -> int:
        """Prompt tokens the step may admit: the next waiting request's where one seat is
        free or one request waits (the common case: a request finished), else the whole
        budget (how many of theirs fit is known only as they are admitted)."""
        waiting, seats = self.policy.num_waiting, shape.max_running - len(self.running)
        if not waiting or seats <= 0:
            return 0
        if waiting > 1 and seats > 1:
            return shape.budget
        req = self.policy.next_waiting(len(self.running), first_tokens=False)
        return 0 if req is None else self.kv.tokens_to_compute(req)

    def _chunks(self, chunks: list[Request], chosen: list[tuple[Request, int]], budget: int) -> int:
        """Prompt chunks of the running requests with more than one token to feed."""
        charge = self.policy.charges_service
        for req in chunks:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted for another's blocks
            computed = req.num_computed_tokens
            n = min(req.num_tokens + req.num_inflight - computed, budget)
            if self.kv.blocks_needed(req, n) > 0:
                if not self.kv.allocate_slots(req, n):
                    if not self._make_room(req, n, chosen):
                        continue
            chosen.append((req, n))
            if charge:
                self.policy.charge_prompt(req, n)
            budget -= n
        return budget

    def _first_token_step(self, shape: StepShape) -> StepPlan | None:
        """The policy's first-token step: the requests it names, and no running prompt's
        chunk; the running decodes ride along where the shape says so."""
        chosen: list[tuple[Request, int]] = []
        new_rows: list[NewRow] = []
        if self.policy.num_waiting:
            self.register_filled()
        budget = self.rows.admit(chosen, new_rows, shape.budget, shape, first_tokens=True)
        if not chosen:
            return None
        self.policy.first_token_step_planned(self.next_step_id)
        if shape.decodes_ride:
            others = self.running[: len(self.running) - len(chosen)]  # not those admitted
            self.rows.decodes(others, chosen, budget, preempt=False)
        return self._plan([chosen_part(chosen, self.table, self.next_step_id)], new_rows)

    def _plan(self, parts: list[PlanPart], new_rows: list[NewRow]) -> StepPlan:
        step_id = self.next_step_id
        self.next_step_id += 1
        return build_plan(step_id, parts, new_rows, self.ledger.take_released_rows())

    def register_filled(self) -> None:
        """Offer the blocks the running rows filled so far to the prefix cache: as many
        tokens as are both held and computed. (Done in bulk before a prefix lookup and as a
        request leaves, not as each block fills: hashing a block per step for every 16 rows
        would be most of a large batch's control-plane work.)"""
        if not self.pool.enable_prefix_cache or not len(self.running):
            return
        t, rows = self.table, self.running.rows()
        known = np.minimum(t.computed[rows], t.tokens[rows])
        for row in rows[known // self.config.block_size > t.hashed[rows]].tolist():
            self.kv.register_full_blocks(t.requests[row])

    # ---------------------------------------------------------------- results
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply one step's emitted tokens; returns the requests that got tokens."""
        self.ledger.step_completed(plan.step_id)
        self._ended = []
        if self.speculation is not None:
            self.speculation.observe(plan, result)
        if result.prompt_logprobs:
            record_prompt_scores(result.prompt_logprobs, plan)
        touched, wasted, rows, counts = apply_step(
            plan, result, self.table, self.config.max_model_len, self.finish
        )
        if self.policy.charges_service and len(rows):
            self.policy.charge_output(self.table.tenant_counts(rows, counts))
        self.wasted_tokens += wasted
        return touched

    def fail_step(self, plan: StepPlan) -> list[Request]:
        """A step raised on the device: only the requests it carried fail."""
        self.ledger.step_completed(plan.step_id)
        self._ended = []
        failed = [req for req in plan.requests if not req.finished]
        for req in failed:
            self.finish(req, FinishReason.ERROR)
        return failed

    def device_lost(
        self,
        can_requeue: Callable[[Request], bool],
        reason: FinishReason = FinishReason.DEVICE_LOST,
    ) -> tuple[list[Request], list[Request]]:
        """The device and all it held are gone: its requests start over (``can_requeue``)
        or end with ``reason`` (``core/device_loss.py``). Returns (ended, started over)."""
        requests, last = list(self.requests.values()), self.next_step_id - 1
        return settle_device_loss(
            requests, self.running, self.policy, self.ledger, last, self.finish, can_requeue, reason
        )

    def finish(
        self, req: Request, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """End a request now (stop, abort, error); its blocks follow its last launched step."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            if self.pool.enable_prefix_cache:
                self.kv.register_full_blocks(req)
            self.running.remove(req)
            self.policy.left_running(req)
        else:
            self.policy.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        self.table.finished(req)
        self.ledger.free_after_launch(req)
        self._ended.append(req)

    def take_ended(self) -> list[Request]:
        """The requests that ended since the last call (the emitter's whole-result readers)."""
        ended, self._ended = self._ended, []
        return ended
