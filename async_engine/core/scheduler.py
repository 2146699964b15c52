"""Plans one step at a time: which requests run, how many tokens each, which KV blocks.

No prefill/decode phases: every request's ``num_computed_tokens`` catches up with its
token count under a per-step token budget, so chunked prefill and mixed batches need no
special case. The budget goes to running decodes first, then to prompt chunks, then to
admissions. The policy (``core/policy``) holds the waiting requests and decides their
order, the victims of preemption, the service counted and each step's shape (budget,
running-slot limit, first-token steps); the scheduler asks it and plans. Blocks of a
request that ends or is preempted return to the pool only once every launched step that
uses them has completed (``core/ledger.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from async_engine.core.device_loss import settle_device_loss
from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.ledger import ReleaseLedger
from async_engine.core.plan_builder import build_plan
from async_engine.core.policy import Policy, StepShape
from async_engine.core.preemption import Preemption
from async_engine.core.request import FinishReason, Request, RequestStatus
from async_engine.core.row_chooser import RowChooser
from async_engine.core.steady import SteadyDecode
from async_engine.core.step_results import apply_step
from blockalloc import BlockPool
from streams.plan import NewRow, StepPlan


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int
    block_size: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, policy: Policy) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.kv = KVCacheManager(pool, config.block_size)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.ledger = ReleaseLedger(self.kv, self.requests)
        self.steady = SteadyDecode(self.kv, pool.enable_prefix_cache, policy)
        self.preemption = Preemption(self.running, policy, self.kv, self.ledger)
        self._make_room = self.preemption.make_room
        self.rows = RowChooser(
            config.block_size, policy, self.kv, self.running, self.ledger, self._make_room
        )
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

    def schedule(self) -> StepPlan | None:
        steady = self.steady
        if steady.active:
            plan = self._run_step()
            if plan is not None:
                self.next_step_id += 1
                return plan
        steady.stop()
        plan = self._schedule()
        if plan is not None:
            steady.try_start(plan, self.running)
        return plan

    def sync_requests(self) -> None:
        """Write back the counters a steady run keeps in arrays (before reading them)."""
        self.steady.stop()

    def _run_step(self) -> StepPlan | None:
        """A step of the steady run (``core/steady.py``): its rows over arrays, the other
        running requests and admissions beside them in full; None: plan in full."""
        steady, step_id, running = self.steady, self.next_step_id, self.running
        if not self.policy.num_waiting and len(running) == steady.size:
            return steady.plan(step_id, self.ledger.take_released_rows)
        policy = self.policy
        shape = policy.step_shape(step_id, running, self.compute_bound)
        if shape.first_tokens:  # a first-token step, if anyone is behind, is planned in full
            if len(running) < shape.max_running and policy.next_waiting(len(running), True):
                return None
            shape = policy.step_shape(step_id, running, self.compute_bound, False)
        # Blocks enough that nothing is preempted: a victim may be a row of the run.
        if self.pool.num_free < shape.budget // self.config.block_size + shape.max_running + 2:
            return None
        part = steady.advance(step_id, shape.budget)
        if part is None:
            return None
        if self.policy.num_waiting:
            steady.register_filled()  # an admission looks its prefix up
        chosen, new_rows = self._plan_beside(steady.others(running), shape, len(part.starts))
        rest = build_plan(step_id, chosen, new_rows, []) if chosen else None
        return steady.assemble(step_id, part, rest, self.ledger.take_released_rows())

    def _schedule(self) -> StepPlan | None:
        step_id, running = self.next_step_id, self.running
        shape = self.policy.step_shape(step_id, running, self.compute_bound)
        if shape.first_tokens:
            plan = self._first_token_step(shape)
            if plan is not None:
                return plan  # else nobody could be admitted into it: an ordinary step
            shape = self.policy.step_shape(
                step_id, running, self.compute_bound, allow_first_tokens=False
            )
        chosen, new_rows = self._plan_beside(list(running), shape, 0)
        if not chosen:
            return None  # released rows ride along with the next real plan
        return self._plan(chosen, new_rows)

    def _plan_beside(
        self, reqs: list[Request], shape: StepShape, run_rows: int
    ) -> tuple[list[tuple[Request, int]], list[NewRow]]:
        """Plan ``reqs`` (running) and admissions in the budget left beside ``run_rows``
        decodes of a steady run; only a step without one may preempt."""
        chosen: list[tuple[Request, int]] = []
        new_rows: list[NewRow] = []
        preemptions_before, preempt = self.preemption.count, run_rows == 0
        budget, chunks = self.rows.decodes(reqs, chosen, shape.budget - run_rows, preempt)
        # A request the policy puts in first-token steps goes before the prompt chunks here
        # too: one that arrived while a first-token step ran does not wait for the next.
        if chunks and self.preemption.count == preemptions_before:
            budget = self.rows.admit(chosen, new_rows, budget, shape, first_tokens=True)
        bs, charge = self.config.block_size, self.policy.charges_service
        for req in chunks:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted for another's blocks
            computed = req.num_computed_tokens
            n = min(req.num_tokens + req.num_inflight - computed, budget)
            if (computed + n + bs - 1) // bs > len(req.block_ids):
                if not self.kv.allocate_slots(req, n):
                    if not preempt or not self._make_room(req, n, chosen):
                        continue
            chosen.append((req, n))
            if charge:
                self.policy.charge_prompt(req, n)
            budget -= n
        # Admit nothing in a step that had to preempt: the pool is short already.
        if self.preemption.count == preemptions_before:
            self.rows.admit(chosen, new_rows, budget, shape, first_tokens=False)
        # A victim may have been chosen before it was preempted (when every request was).
        return [(r, n) for r, n in chosen if r.status is RequestStatus.RUNNING], new_rows

    def _first_token_step(self, shape: StepShape) -> StepPlan | None:
        """The policy's first-token step: the requests it names, and no running prompt's
        chunk; the running decodes ride along where the shape says so."""
        chosen: list[tuple[Request, int]] = []
        new_rows: list[NewRow] = []
        budget = self.rows.admit(chosen, new_rows, shape.budget, shape, first_tokens=True)
        if not chosen:
            return None
        self.policy.first_token_step_planned(self.next_step_id)
        if shape.decodes_ride:
            others = self.running[: len(self.running) - len(chosen)]  # not those admitted
            self.rows.decodes(others, chosen, budget, preempt=False)
        return self._plan(chosen, new_rows)

    def _plan(self, chosen: list[tuple[Request, int]], new_rows: list[NewRow]) -> StepPlan:
        step_id = self.next_step_id
        self.next_step_id += 1
        return build_plan(step_id, chosen, new_rows, self.ledger.take_released_rows())

    def update_from_output(
        self,
        plan: StepPlan,
        tokens: list[int],
        logprobs: list[float] | None = None,
        top_logprobs: list[list[tuple[int, float]]] | None = None,
    ) -> list[Request]:
        """Apply one step's sampled tokens; returns the requests that got a token."""
        self.ledger.step_completed(plan.step_id)
        self._ended = []
        register, max_len = self.pool.enable_prefix_cache, self.config.max_model_len
        if self.steady.owns(plan):  # core/steady.py: its rows first, then the rest in full
            tokens = np.asarray(tokens)
            touched, wasted, rest = self.steady.apply(plan, tokens, max_len, self.finish)
            if rest is not None:
                k = len(touched) + wasted  # the run's rows, each sampled
                if logprobs is not None:
                    logprobs = logprobs[k:]
                    top_logprobs = top_logprobs[k:] if top_logprobs is not None else None
                more, lost = apply_step(
                    rest,
                    tokens[k:],
                    logprobs,
                    top_logprobs,
                    self.kv,
                    register,
                    max_len,
                    self.finish,
                )
                if self.policy.charges_service:
                    self.policy.charge_output(more)
                touched, wasted = touched + more, wasted + lost
        else:
            self.steady.sync()  # a step launched before a run: its counters first
            touched, wasted = apply_step(
                plan, tokens, logprobs, top_logprobs, self.kv, register, max_len, self.finish
            )
            if self.policy.charges_service:
                self.policy.charge_output(touched)
        self.wasted_tokens += wasted
        return touched

    def fail_step(self, plan: StepPlan) -> list[Request]:
        """A step raised on the device: only the requests it carried fail."""
        self.steady.stop()
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
        self.steady.stop()
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
            if self.steady.active:
                self.steady.leave(req)
            self.running.remove(req)
            self.policy.left_running(req)
        else:
            self.policy.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        self.ledger.free_after_launch(req)
        self._ended.append(req)

    def take_ended(self) -> list[Request]:
        """The requests that ended since the last call (the emitter's whole-result readers)."""
        ended, self._ended = self._ended, []
        return ended
