"""Plans one step at a time: which requests run, how many tokens each, which KV slots.

No prefill/decode phases: every request's ``num_computed_tokens`` catches up with its
token count under a per-step token budget, so chunked prefill and mixed batches need no
special case. Blocks of a request that ends are returned only once every launched step
that uses them has completed (``step_completed``), because under overlap the next step
may already be writing them.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from async_engine.kv_manager import KVCacheManager
from async_engine.request import FinishReason, Request, RequestStatus
from blockalloc import BlockPool
from streams.plan import PLACEHOLDER, NewSlot, StepPlan


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.kv = KVCacheManager(pool, config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: list[tuple[int, int, Request]] = []  # heap of (priority, arrival, req)
        self.running: list[Request] = []
        self.next_step_id = 0
        self.completed_step_id = -1
        self._deferred: list[Request] = []  # ended, blocks still used by a launched step
        self._free_slots: list[int] = []
        self._num_slots = 0
        self._released_slots: list[int] = []
        self.num_preemptions = 0
        self.wasted_tokens = 0
        self.num_finished = 0

    # ----------------------------------------------------------------- intake
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        self.requests[req.request_id] = req
        heapq.heappush(self.waiting, (req.priority, req.arrival_seq, req))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # --------------------------------------------------------------- planning
    def schedule(self) -> StepPlan | None:
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        new_slots: list[NewSlot] = []
        preempted = False

        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._num_new_tokens(req, budget)
            if n == 0:
                continue
            while not self.kv.allocate_slots(req, n):
                if self._blocks_arriving() >= self.kv.blocks_needed(req, n) - self.pool.num_free:
                    break  # blocks of ended requests come back after the running step
                victim = self._pick_victim(exclude=[r for r, _ in chosen])
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                chosen.append((req, n))
                budget -= n

        while self.waiting and not preempted and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0][2]
            if req.num_computed_tokens == 0 and not req.block_ids:
                self.kv.lookup_prefix(req)
            n = self._num_new_tokens(req, budget)
            if n == 0 or not self.kv.allocate_slots(req, n):
                self.kv.release(req)  # give back prefix-cache hits; retry next step
                req.num_computed_tokens = 0
                break
            heapq.heappop(self.waiting)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            if req.slot is None:
                req.slot = self._take_slot()
                new_slots.append(self._new_slot(req))
            self.running.append(req)
            chosen.append((req, n))
            budget -= n

        if not chosen:
            return None  # released slots ride along with the next real plan
        return self._build_plan(chosen, new_slots)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        pending = req.num_tokens + req.num_inflight
        max_tokens = req.params.max_tokens
        if max_tokens is not None and len(req.output_ids) + req.num_inflight >= max_tokens:
            return 0  # its last token is in flight: it ends when that is applied
        if pending >= self.config.max_model_len:
            return 0
        return min(pending - req.num_computed_tokens, budget)

    def _build_plan(self, chosen: list[tuple[Request, int]], new_slots: list[NewSlot]) -> StepPlan:
        step_id = self.next_step_id
        self.next_step_id += 1
        bs = self.config.block_size
        plan = StepPlan(
            step_id=step_id, request_ids=[], slots=[], query_lens=[], context_lens=[],
            input_ids=[], positions=[], slot_mapping=[], block_tables=[], sample=[],
            new_slots=new_slots, released_slots=self._released_slots,
        )  # fmt: skip
        self._released_slots = []
        for req, n in chosen:
            start = req.num_computed_tokens
            end = start + n
            known = req.num_tokens
            plan.request_ids.append(req.request_id)
            plan.slots.append(req.slot)
            plan.query_lens.append(n)
            plan.context_lens.append(end)
            for pos in range(start, end):
                plan.input_ids.append(req.token_at(pos) if pos < known else PLACEHOLDER)
                plan.slot_mapping.append(req.block_ids[pos // bs] * bs + pos % bs)
            plan.positions.extend(range(start, end))
            plan.block_tables.append(list(req.block_ids))
            samples = end == known + req.num_inflight
            plan.sample.append(samples)
            req.num_computed_tokens = end
            req.last_launched_step = step_id
            if samples:
                req.num_inflight += 1
        return plan

    def _blocks_arriving(self) -> int:
        return sum(len(r.block_ids) for r in self._deferred)

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._num_slots += 1
        return self._num_slots - 1

    def _new_slot(self, req: Request) -> NewSlot:
        stop_ids = list(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stop_ids += [t for t in req.eos_ids if t not in stop_ids]
        return NewSlot(req.slot, req.params, list(req.prompt_ids), stop_ids)

    # ------------------------------------------------------------ preemption
    def _pick_victim(self, exclude: list[Request]) -> Request:
        # Lowest priority first (largest number), newest among equals: recompute is cheapest there.
        candidates = [r for r in self.running if r not in exclude] or self.running
        return max(candidates, key=lambda r: (r.priority, r.arrival_seq))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._defer_or_release(req, keep_slot=True)
        heapq.heappush(self.waiting, (req.priority, req.arrival_seq, req))

    # ---------------------------------------------------------- step results
    def step_completed(self, step_id: int) -> None:
        """The device finished ``step_id`` (and every step before it): their blocks are idle."""
        self.completed_step_id = max(self.completed_step_id, step_id)
        still: list[Request] = []
        for req in self._deferred:
            if req.last_launched_step <= self.completed_step_id:
                self._release_now(req)
            else:
                still.append(req)
        self._deferred = still

    def update_from_output(
        self,
        plan: StepPlan,
        tokens: list[int],
        logprobs: list[float] | None = None,
        top_logprobs: list[list[tuple[int, float]]] | None = None,
    ) -> list[Request]:
        """Apply one step's sampled tokens; returns the requests that got a token."""
        self.step_completed(plan.step_id)
        now = time.monotonic()
        touched: list[Request] = []
        row = 0
        for rid, sampled in zip(plan.request_ids, plan.sample, strict=True):
            req = self.requests.get(rid)
            if not sampled:
                if req is not None and not req.finished:
                    self.kv.register_full_blocks(req)
                continue
            token = tokens[row]
            if req is None or req.finished:
                self.wasted_tokens += 1  # launched before the request ended
                row += 1
                continue
            req.num_inflight -= 1
            req.output_ids.append(token)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[row])
            if top_logprobs is not None:
                req.output_top_logprobs.append(top_logprobs[row])
            row += 1
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            self.kv.register_full_blocks(req)
            reason = self._check_stop(req, token)
            if reason is not None:
                self.finish(req, reason, stop_reason=token if reason is FinishReason.STOP else None)
            touched.append(req)
        return touched

    def fail_step(self, plan: StepPlan) -> list[Request]:
        """A step raised on the device: only the requests it carried fail."""
        self.step_completed(plan.step_id)
        failed = []
        for rid in plan.request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                self.finish(req, FinishReason.ERROR)
                failed.append(req)
        return failed

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if len(req.output_ids) >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token in req.eos_ids:
                return FinishReason.EOS
        if params.max_tokens is not None and len(req.output_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return FinishReason.CONTEXT_LENGTH
        return None

    # ------------------------------------------------------------ finishing
    def finish(
        self, req: Request, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """End a request now (stop, abort, error); its blocks follow its last launched step."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting = [e for e in self.waiting if e[2] is not req]
            heapq.heapify(self.waiting)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        self.num_finished += 1
        self._defer_or_release(req, keep_slot=False)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.finish(req, FinishReason.ABORTED)
        return req

    def _defer_or_release(self, req: Request, keep_slot: bool) -> None:
        if req.last_launched_step <= self.completed_step_id:
            self._release_now(req, keep_slot)
        elif keep_slot:
            # Preempted while a launched step still writes its blocks: hand the blocks over
            # to a stand-in so the request itself can be re-admitted with a fresh table.
            stand_in = Request(req.request_id, [], req.params)
            stand_in.block_ids, req.block_ids = req.block_ids, []
            stand_in.last_launched_step = req.last_launched_step
            stand_in.status = RequestStatus.WAITING
            req.block_hashes = []
            self._deferred.append(stand_in)
        else:
            self._deferred.append(req)

    def _release_now(self, req: Request, keep_slot: bool = False) -> None:
        self.kv.release(req)
        req.released_time = time.monotonic()
        if not keep_slot and req.slot is not None and req.finished:
            self._released_slots.append(req.slot)
            self._free_slots.append(req.slot)
            req.slot = None
        if req.finished and self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
