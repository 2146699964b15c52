"""Plans one step at a time: which requests run, how many tokens each, which KV blocks.

No prefill/decode phases: every request's ``num_computed_tokens`` catches up with its
token count under a per-step token budget, so chunked prefill and mixed batches need no
special case. The budget goes to running decodes first, then to prompt chunks, then to
admissions. Blocks of a request that ends or is preempted go into a ledger and return
to the pool only once every launched step that uses them has completed
(``step_completed``), because under overlap the next step may already be writing them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.queues import OrderedQueue, WaitQueue
from async_engine.core.request import FinishReason, Request, RequestStatus
from blockalloc import BlockPool
from streams.plan import PLACEHOLDER, NewRow, StepPlan, bools, int32s, int64s


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    # Every token of a step costs the device about the same (a CPU), unlike a GPU that
    # reads the weights once for a whole batch. Then a step that gives light tenants
    # their first token carries no decodes, and while such a tenant, served by one
    # lately, is behind, the steps are half the budget: its next request waits less for
    # the step in flight.
    compute_bound: bool = False


# A light tenant given a first-token step within this many steps is a trickle that
# keeps arriving (worth halving the steps for); past it, one that only drains.
TRICKLE_STEPS = 8


@dataclass(slots=True)
class PendingFree:
    """Blocks to free once step ``after_step`` has completed (and the request to retire)."""

    after_step: int
    blocks: list[int]
    request: Request | None  # a finished request: its row and id are released too


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, pool: BlockPool, queue: WaitQueue | None = None
    ) -> None:
        self.config = config
        self.pool = pool
        self.kv = KVCacheManager(pool, config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: WaitQueue = queue if queue is not None else OrderedQueue(by_priority=True)
        self.running: list[Request] = []
        self.next_step_id = 0
        self.completed_step_id = -1
        self.pending_frees: list[PendingFree] = []
        self._free_rows: list[int] = []
        self._num_rows = 0
        self._released_rows: list[int] = []  # sent with the next plan
        self.num_preemptions = 0
        self.wasted_tokens = 0
        self._first_token_step_id = -2  # the last first-token step's id

    # ----------------------------------------------------------------- intake
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        self.requests[req.request_id] = req
        max_tokens = req.params.max_tokens
        req.token_limit = self.config.max_model_len
        if max_tokens is not None:
            req.token_limit = min(req.token_limit, len(req.prompt_ids) + max_tokens)
        self.waiting.push(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def tenant_depths(self, limit: int = 64) -> list[tuple[str, int, int]]:
        """(tenant, waiting, running) of tenants with work, most waiting first."""
        depths: dict[str, list[int]] = {}
        for req in self.requests.values():
            if req.status is RequestStatus.WAITING:
                depths.setdefault(req.tenant, [0, 0])[0] += 1
            elif req.status is RequestStatus.RUNNING:
                depths.setdefault(req.tenant, [0, 0])[1] += 1
        ranked = sorted(depths.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))
        return [(name, w, r) for name, (w, r) in ranked[:limit]]

    def has_work(self) -> bool:
        return bool(self.running or len(self.waiting))

    # --------------------------------------------------------------- planning
    def schedule(self) -> StepPlan | None:
        prefilling = self.prefilling_tenants()
        if self.next_step_id - self._first_token_step_id >= 2:  # never two in a row
            plan = self._first_token_step(prefilling)  # None unless a tenant behind waits
            if plan is not None:
                return plan
        budget = self.config.max_num_batched_tokens
        if (
            self.config.compute_bound
            and self.next_step_id - self._first_token_step_id <= TRICKLE_STEPS
            and self.waiting.contended(self.config.max_num_seqs, prefilling)
        ):
            budget = max(1, budget // 2)
        chosen: list[tuple[Request, int]] = []
        new_rows: list[NewRow] = []
        preemptions_before = self.num_preemptions

        # The hot loop: every running request, every step. Kept to plain arithmetic.
        # Decodes first, prompt chunks with what is left: a long prompt admitted earlier
        # must not take a whole step's budget from the decodes behind it in the list.
        bs = self.config.block_size
        running = RequestStatus.RUNNING
        choose = chosen.append
        charges = self.waiting.charges
        chunks: list[Request] = []
        for req in list(self.running):
            if req.status is not running:
                continue  # preempted earlier in this loop
            pending = req.num_tokens + req.num_inflight
            if pending >= req.token_limit:
                continue  # its last token is in flight: it ends when that is applied
            computed = req.num_computed_tokens
            n = pending - computed
            if n != 1:
                if n > 1:
                    chunks.append(req)
                continue
            if (computed + bs) // bs > len(req.block_ids):
                if not self.kv.allocate_slots(req, 1) and not self._make_room(req, 1, chosen):
                    continue
            choose((req, 1))
            if charges and computed < len(req.prompt_ids):
                self._charge_prompt(req, 1)  # a prompt's last token, left by a chunk
            budget -= 1
            if budget == 0:
                break
        # A tenant behind in the batch goes before the others' prompt chunks here too: one
        # that arrived while a first-token step ran does not wait for the next such step.
        if chunks and self.num_preemptions == preemptions_before:
            budget = self._admit(chosen, new_rows, budget, prefilling, first_tokens_only=True)
        for req in chunks:
            if budget == 0:
                break
            if req.status is not running:
                continue
            computed = req.num_computed_tokens
            n = min(req.num_tokens + req.num_inflight - computed, budget)
            if (computed + n + bs - 1) // bs > len(req.block_ids):
                if not self.kv.allocate_slots(req, n) and not self._make_room(req, n, chosen):
                    continue
            choose((req, n))
            if charges:
                self._charge_prompt(req, n)
            budget -= n

        # Admit nothing in a step that had to preempt: the pool is short already.
        if self.num_preemptions == preemptions_before:
            self._admit(chosen, new_rows, budget, prefilling, first_tokens_only=False)
        # A victim may have been chosen before it was preempted (when every request was).
        chosen = [(r, n) for r, n in chosen if r.status is RequestStatus.RUNNING]
        if not chosen:
            return None  # released rows ride along with the next real plan
        return self._build_plan(chosen, new_rows)

    def prefilling_tenants(self) -> set[str]:
        """Tenants with a running prompt not yet planned to its end (a fair queue's concern:
        only admissions, and a compute-bound device's halving, ask)."""
        if not self.waiting.charges or not (len(self.waiting) or self.config.compute_bound):
            return set()
        return {r.tenant for r in self.running if r.num_computed_tokens < len(r.prompt_ids)}

    def _first_token_step(self, prefilling: set[str]) -> StepPlan | None:
        """A step for the requests of tenants behind in the batch, ahead of the other
        tenants' prefill chunks: their first token is one step away, not behind a burst's.
        Running decodes ride along unless the device is compute bound. Never two such steps
        in a row: the others' prefill and (compute bound) decodes keep every other step."""
        chosen: list[tuple[Request, int]] = []
        new_rows: list[NewRow] = []
        budget = self._admit(chosen, new_rows, self.config.max_num_batched_tokens, prefilling,
                             first_tokens_only=True)  # fmt: skip
        if not chosen:
            return None
        self._first_token_step_id = self.next_step_id
        if not self.config.compute_bound:
            for req in self.running[: len(self.running) - len(chosen)]:  # not those admitted
                if budget == 0:
                    break
                pending = req.num_tokens + req.num_inflight
                if pending >= req.token_limit:
                    continue
                if pending - req.num_computed_tokens == 1 and self.kv.allocate_slots(req, 1):
                    chosen.append((req, 1))
                    self._charge_prompt(req, 1)  # if it is a prompt's last token
                    budget -= 1
        return self._build_plan(chosen, new_rows)

    def _admit(
        self,
        chosen: list[tuple[Request, int]],
        new_rows: list[NewRow],
        budget: int,
        prefilling: set[str],
        first_tokens_only: bool,
    ) -> int:
        """Move waiting requests into the running set while budget, slots and blocks allow;
        returns the budget left. ``first_tokens_only``: just those of tenants behind."""
        waiting, seqs = self.waiting, self.config.max_num_seqs
        while len(waiting) and budget > 0:
            if first_tokens_only or len(self.running) >= seqs:
                # A full batch still takes a tenant behind (up to a quarter more slots):
                # otherwise one tenant's burst holds every slot until it ends.
                if len(self.running) >= seqs + seqs // 4:
                    break
                req = waiting.next_behind(seqs, prefilling, light=first_tokens_only)
                if req is None:
                    break
            else:
                req = waiting.peek()
            if req.num_computed_tokens == 0 and not req.block_ids:
                self.kv.lookup_prefix(req)
            n = self._num_new_tokens(req, budget)
            if n == 0 or not self.kv.allocate_slots(req, n):
                self.kv.release(req)  # give back prefix-cache hits; retry next step
                req.num_computed_tokens = 0
                break
            waiting.pop(req)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            if req.row is None:
                req.row = self._take_row()
                new_rows.append(self._new_row(req))
            self.running.append(req)
            chosen.append((req, n))
            if waiting.charges:
                self._charge_prompt(req, n)  # at once: the next admission's order depends on it
            budget -= n
        return budget

    @staticmethod
    def _charge_prompt(req: Request, n: int) -> None:
        """Count the prompt tokens among the ``n`` planned from ``num_computed_tokens`` on
        as service of the request's tenant (a fair queue's counter)."""
        start, prompt = req.num_computed_tokens, len(req.prompt_ids)
        if start < prompt:
            tenant = req.tenant_state
            tenant.counter += (min(start + n, prompt) - start) * tenant.prompt_cost

    def _make_room(self, req: Request, n: int, chosen: list[tuple[Request, int]]) -> bool:
        """Preempt until ``req`` gets its blocks; False if it cannot run this step."""
        while True:
            if self._blocks_arriving() >= self.kv.blocks_needed(req, n) - self.pool.num_free:
                return False  # blocks of ended requests come back after the running step
            victim = self.waiting.victim(self.running, [r for r, _ in chosen])
            self._preempt(victim)
            if victim is req:
                return False
            if self.kv.allocate_slots(req, n):
                return True

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        pending = req.num_tokens + req.num_inflight
        if pending >= req.token_limit:
            return 0  # its last token is in flight: it ends when that is applied
        return min(pending - req.num_computed_tokens, budget)

    def _build_plan(self, chosen: list[tuple[Request, int]], new_rows: list[NewRow]) -> StepPlan:
        step_id = self.next_step_id
        self.next_step_id += 1
        rows: list[int] = []
        starts: list[int] = []
        query_lens: list[int] = []
        sample: list[bool] = []
        inputs: list[int] = []
        resets: list[int] = []
        new_blocks: list[int] = []
        requests: list[Request] = []
        # Bound methods held in locals: this loop runs for every request on every step.
        add_row, add_start, add_len = rows.append, starts.append, query_lens.append
        add_sample, add_input, add_request = sample.append, inputs.append, requests.append
        for req, n in chosen:
            start = req.num_computed_tokens
            known = req.num_tokens
            row = req.row
            add_row(row)
            add_start(start)
            add_len(n)
            add_request(req)
            end = start + n
            if start >= known:  # steady decode: the token was sampled by a step in flight
                if n == 1:
                    add_input(PLACEHOLDER)
                else:
                    inputs += [PLACEHOLDER] * n
            elif end <= known:
                inputs += req.tokens_between(start, end)
            else:
                inputs += req.tokens_between(start, known)
                inputs += [PLACEHOLDER] * (end - known)
            if req.table_reset:
                resets.append(row)
                req.table_reset = False
            if len(req.block_ids) > req.num_sent_blocks:
                for block in req.block_ids[req.num_sent_blocks :]:
                    new_blocks += (row, block)
                req.num_sent_blocks = len(req.block_ids)
            if end == known + req.num_inflight:
                add_sample(True)
                req.num_inflight += 1
            else:
                add_sample(False)
            req.num_computed_tokens = end
            req.last_launched_step = step_id
        released, self._released_rows = self._released_rows, []
        return StepPlan(
            step_id=step_id, rows=int32s(rows), starts=int32s(starts),
            query_lens=int32s(query_lens), sample=bools(sample), input_ids=int64s(inputs),
            new_rows=new_rows, released_rows=int32s(released), reset_rows=int32s(resets),
            new_blocks=int32s(new_blocks), requests=requests,
        )  # fmt: skip

    def _blocks_arriving(self) -> int:
        return sum(len(p.blocks) for p in self.pending_frees)

    def _take_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        self._num_rows += 1
        return self._num_rows - 1

    def _new_row(self, req: Request) -> NewRow:
        stop_ids = list(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stop_ids += [t for t in req.eos_ids if t not in stop_ids]
        return NewRow(req.row, req.params, list(req.prompt_ids), stop_ids)

    # ------------------------------------------------------------ preemption
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.waiting.stopped_running(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._free_blocks_after_launch(req)
        req.table_reset = True  # it keeps its row; the device's table starts over
        req.num_sent_blocks = 0
        self.waiting.push(req)

    # ---------------------------------------------------------- step results
    def step_completed(self, step_id: int) -> None:
        """The device finished ``step_id`` (and every step before it): their blocks are idle."""
        self.completed_step_id = max(self.completed_step_id, step_id)
        if not self.pending_frees:
            return
        still: list[PendingFree] = []
        for pending in self.pending_frees:
            if pending.after_step <= self.completed_step_id:
                self.kv.free(pending.blocks)
                if pending.request is not None:
                    self._retire(pending.request)
            else:
                still.append(pending)
        self.pending_frees = still

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
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else tokens
        register = self.pool.enable_prefix_cache
        bs = self.config.block_size
        finished = RequestStatus.FINISHED
        add_touched = touched.append
        charge = self.waiting.charges
        row = 0
        for req, sampled in zip(plan.requests, plan.sample.tolist(), strict=True):
            if not sampled:
                if register and req.status is not finished:
                    self.kv.register_full_blocks(req)
                continue
            token = tokens[row]
            if req.status is finished:
                self.wasted_tokens += 1  # launched before the request ended
                row += 1
                continue
            req.num_inflight -= 1
            if charge:
                req.tenant_state.counter += req.tenant_state.output_cost
            req.output_ids.append(token)
            req.num_tokens += 1
            req.token_times.append(now)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[row])
                if top_logprobs is not None:
                    req.output_top_logprobs.append(top_logprobs[row])
            row += 1
            if req.first_token_time is None:
                req.first_token_time = now
            # Only a step that completes a block has anything to register.
            if register and req.num_computed_tokens // bs > len(req.block_hashes):
                self.kv.register_full_blocks(req)
            if token in req.stop_ids or req.num_tokens >= req.token_limit:
                reason = self._check_stop(req, token)
                if reason is not None:
                    stop = token if reason is FinishReason.STOP else None
                    self.finish(req, reason, stop_reason=stop)
            add_touched(req)
        return touched

    def fail_step(self, plan: StepPlan) -> list[Request]:
        """A step raised on the device: only the requests it carried fail."""
        self.step_completed(plan.step_id)
        failed = []
        for req in plan.requests:
            if not req.finished:
                self.finish(req, FinishReason.ERROR)
                failed.append(req)
        return failed

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token in req.stop_ids and len(req.output_ids) >= params.min_tokens:
            return FinishReason.STOP if token in params.stop_token_ids else FinishReason.EOS
        if params.max_tokens is not None and len(req.output_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return FinishReason.CONTEXT_LENGTH
        return None

    def device_lost(
        self,
        can_requeue: Callable[[Request], bool],
        reason: FinishReason = FinishReason.DEVICE_LOST,
    ) -> tuple[list[Request], list[Request]]:
        """The device and all it held (KV cache, row tables) are gone: every launched step
        counts as completed, every block returns and rows start over on the next device.

        A request the device had touched goes back to waiting, to be computed afresh with
        no output, where ``can_requeue`` allows; otherwise it ends with ``reason``. Waiting
        requests never admitted are untouched. Returns (ended, started over).
        """
        self.step_completed(self.next_step_id - 1)
        ended: list[Request] = []
        again: list[Request] = []
        for req in list(self.requests.values()):
            if req.finished:
                continue
            touched = req.status is RequestStatus.RUNNING or req.row is not None
            if not touched:
                continue
            if can_requeue(req):
                self._start_over(req)
                again.append(req)
            else:
                self.finish(req, reason)
                ended.append(req)
        self._free_rows, self._num_rows, self._released_rows = [], 0, []
        self.pool.reset_prefix_cache()  # the cached KV lived on the lost device
        return ended, again

    def _start_over(self, req: Request) -> None:
        was_running = req.status is RequestStatus.RUNNING
        if was_running:
            self.running.remove(req)
            self.waiting.stopped_running(req)
        self.kv.release(req)
        req.status = RequestStatus.WAITING
        req.row = None
        req.num_computed_tokens = req.num_inflight = req.num_cached_tokens = 0
        req.num_sent_blocks = 0
        req.table_reset = False
        req.last_launched_step = -1
        req.output_ids, req.output_logprobs, req.output_top_logprobs = [], [], []
        req.token_times, req.first_token_time = [], None
        req.num_tokens = len(req.prompt_ids)
        req.num_device_losses += 1
        if was_running:
            self.waiting.push(req)

    # ------------------------------------------------------------ finishing
    def finish(
        self, req: Request, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """End a request now (stop, abort, error); its blocks follow its last launched step."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.waiting.stopped_running(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        self._free_blocks_after_launch(req)

    def _free_blocks_after_launch(self, req: Request) -> None:
        """Free now if no launched step still uses the blocks, else after that step."""
        retire = req if req.finished else None
        if req.last_launched_step <= self.completed_step_id:
            self.kv.release(req)
            if retire is not None:
                self._retire(retire)
            return
        self.pending_frees.append(PendingFree(req.last_launched_step, self.kv.detach(req), retire))

    def _retire(self, req: Request) -> None:
        """A finished request whose blocks are back: its row and its id are free again."""
        req.released_time = time.monotonic()
        if req.row is not None:
            self._released_rows.append(req.row)
            self._free_rows.append(req.row)
            req.row = None
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
