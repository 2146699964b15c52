"""Steady decode: the running requests that only decode, planned and applied over arrays
instead of request by request.

At a GPU's 1 ms steps and a batch of hundreds, touching every request twice a step in
Python is most of the control plane's time. After a plan whose leading rows are the first
running requests, each decoding one token past its prompt with no logprobs wanted, those
rows form a run: each row's computed-token count lives in an array, the run's part of the
next plan is the last one shifted by a token, and a step's tokens are appended to the
requests' output lists in one pass of C-level iteration. Only the rows that change go
through Python: one that needs a new KV block, one whose token may end it, one that
leaves or joins. Beside the run, the scheduler plans the other running requests (prompts
being computed) and admissions in full, in the same step (``assemble``); a request whose
prompt is done joins the run, which stays the first rows of each plan, in the order the
full scheduler would give them. A row leaves when its request ends, or once its last
token is in flight (it is planned no more; its last token is applied as the others' are).
A preemption, a first-token step someone is behind for, or a step whose blocks may run
short ends the run. The blocks a run's decodes fill are offered to the prefix cache when
their row leaves, the run stops or an admission is about to look a prefix up, not as each
fills: hashing a block a step per 16 rows was most of a step's work at batch 256.

While a row is in a run, four of its request's fields are not kept up to date:
``num_computed_tokens``, ``num_inflight``, ``num_tokens`` and ``last_launched_step``.
They are written back when the row leaves or the run stops; the scheduler stops the run
before anything else reads them (a lost device, a failed step, a metrics scrape).

Invariant, per row of a run: it has exactly one token to feed, so after each launch
``num_tokens + num_inflight == computed + 1``; once step P (which computed position
``starts[i]``) is applied, the row holds ``starts[i] + 2`` tokens.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from itertools import repeat

import numpy as np

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.policy import Policy
from async_engine.core.request import FinishReason, Request, RequestStatus
from async_engine.core.steady_batch import (
    Batch,
    RunPart,
    joinable,
    merge_plans,
    plan_beside_run,
)
from async_engine.core.step_results import check_stop
from streams.plan import PLACEHOLDER, StepPlan

_EMPTY32 = np.zeros(0, np.int32)
Finish = Callable[[Request, FinishReason, int | None], None]


class SteadyDecode:
    MIN_ROWS = 4  # a run of fewer rows saves less than planning beside it costs

    def __init__(self, kv: KVCacheManager, register_blocks: bool, policy: Policy) -> None:
        self.kv = kv
        self.policy = policy
        self.block_size = kv.block_size
        self.register_blocks = register_blocks
        self.active = False
        self._batches: dict[int, Batch] = {}  # the batch of each of the run's plans in flight

    @property
    def size(self) -> int:
        """Rows in the run now."""
        return len(self._index)

    def others(self, running: list[Request]) -> list[Request]:
        """The running requests outside the run, in running order."""
        index = self._index
        return [req for req in running if req not in index]

    # ------------------------------------------------------------ start, stop
    def try_start(self, plan: StepPlan, running: list[Request]) -> None:
        """Start a run after ``plan`` with its leading rows that are the first running
        requests, each decoding one token past its prompt with no logprobs asked."""
        if self.active or len(plan.reset_rows):
            return
        n = 0
        starts, sizes = plan.starts.tolist(), plan.query_lens.tolist()
        rows = zip(plan.requests, starts, sizes, plan.sample, strict=True)
        for (req, start, size, sampled), other in zip(rows, running, strict=False):
            if req is not other or not joinable(req, start, size, sampled):
                break
            n += 1
        if n < self.MIN_ROWS:
            return
        reqs = plan.requests[:n]
        self.active = True
        self._last_step_id = plan.step_id
        self._index = {req: i for i, req in enumerate(reqs)}
        self._leaving: list[int] = []
        stops = {t for r in reqs for t in r.stop_ids}
        self.stop_ids = np.fromiter(stops, np.int64, len(stops))
        self.batch = Batch.of(reqs, plan.rows[:n], self.block_size, self._charger(reqs))

    def stop(self) -> None:
        """End the run: write back the request fields it kept in arrays and offer its
        filled blocks to the prefix cache. Its plans still in flight are then applied in
        full."""
        if not self.active:
            return
        self.sync()
        if self.register_blocks:
            for req in self._index:
                self.kv.register_full_blocks(req)
        self.active = False
        self._batches.clear()

    def sync(self) -> None:
        """Write the request fields back without ending the run (a step launched before it
        is applied in full)."""
        if not self.active:
            return
        for req, i in self._index.items():
            self._sync(req, int(self.batch.computed[i]))

    def leave(self, req: Request) -> None:
        """``req`` ended: its row leaves the run (at the next plan), its fields up to date."""
        i = self._index.pop(req, None)
        if i is not None:
            self._sync(req, int(self.batch.computed[i]))
            self._leaving.append(i)
        if self.register_blocks:
            self.kv.register_full_blocks(req)

    def _sync(self, req: Request, computed: int) -> None:
        req.num_tokens = len(req.prompt_ids) + len(req.output_ids)
        req.num_computed_tokens = computed
        req.num_inflight = computed + 1 - req.num_tokens
        req.last_launched_step = self._last_step_id

    def _charger(self, reqs: list[Request], tokens: int = 1) -> tuple[Callable[[], None], ...]:
        if not self.policy.charges_service:
            return ()
        return (self.policy.output_charger(reqs, tokens),)

    # ----------------------------------------------------------------- plans
    def plan(self, step_id: int, released_rows: Callable[[], list[int]]) -> StepPlan | None:
        """The run's next plan, the run alone; None where the run cannot go on (nobody
        left, or a row's new block is not to be had): then ``stop`` and plan in full."""
        part = self.advance(step_id, None)
        return None if part is None else self.assemble(step_id, part, None, released_rows())

    def advance(self, step_id: int, budget: int | None) -> RunPart | None:
        """Plan the run's rows for step ``step_id``, one token each, within ``budget``;
        None where the run cannot go on as it is."""
        done = self.batch.computed + 1 >= self.batch.limit  # their last token is in flight
        if done.any():
            for i in np.flatnonzero(done).tolist():
                req = self.batch.reqs[i]
                if self._index.pop(req, None) is not None:
                    self._sync(req, int(self.batch.computed[i]))
                    self._leaving.append(i)
                    if self.register_blocks:
                        self.kv.register_full_blocks(req)
        if self._leaving:
            self._compact()
        if not self.batch.reqs or (budget is not None and len(self.batch.reqs) > budget):
            return None
        computed = self.batch.computed
        growing = np.flatnonzero(computed >= self.batch.capacity).tolist()  # at a block's start
        new_blocks: list[int] = []
        if growing:  # one block each, all or none: the pool hands out what one by one would
            blocks = self.kv.pool.allocate(len(growing))
            if blocks is None:
                return None  # the full plan allocates, or preempts
            reqs, rows = self.batch.reqs, self.batch.rows
            for i, block in zip(growing, blocks, strict=True):
                req = reqs[i]
                req.block_ids.append(block)
                for sent in req.block_ids[req.num_sent_blocks :]:
                    new_blocks += (int(rows[i]), sent)
                req.num_sent_blocks = len(req.block_ids)
            self.batch.capacity[growing] += self.block_size
        starts = computed.astype(np.int32)
        computed += 1
        self._last_step_id = step_id
        return RunPart(self.batch, starts, new_blocks)

    def assemble(
        self, step_id: int, part: RunPart, rest: StepPlan | None, released: list[int]
    ) -> StepPlan:
        """One step's plan: the run's rows first, then ``rest`` (the others, planned in
        full, released rows apart). Requests of ``rest`` whose prompt is done join."""
        n = len(part.starts)
        self._batches[step_id] = part.batch
        plan = StepPlan(
            step_id=step_id,
            rows=part.batch.rows,
            starts=part.starts,
            query_lens=np.ones(n, np.int32),
            sample=np.ones(n, bool),
            input_ids=np.full(n, PLACEHOLDER, np.int64),
            released_rows=np.array(released, np.int32),
            new_blocks=np.array(part.new_blocks, np.int32) if part.new_blocks else _EMPTY32,
            requests=part.batch.reqs,
        )
        if rest is None:
            return plan
        self._join(rest)
        return merge_plans(plan, rest)

    def _join(self, rest: StepPlan) -> None:
        """The leading requests of ``rest`` planned one sampled token past their prompt
        join the run (only leading ones: the run stays a prefix of the plan's order)."""
        joining = []
        starts, sizes = rest.starts.tolist(), rest.query_lens.tolist()
        for req, start, size, sampled in zip(
            rest.requests, starts, sizes, rest.sample, strict=True
        ):
            if not joinable(req, start, size, sampled):
                break
            joining.append(req)
        if not joining:
            return
        if self._leaving:
            self._compact()
        rows = np.array([r.row for r in joining], np.int32)
        joined = Batch.of(joining, rows, self.block_size, self._charger(joining))
        self.batch = self.batch.extend(joined)  # a new batch: the plans in flight keep theirs
        start = len(self.batch.reqs) - len(joining)
        self._index.update((req, start + i) for i, req in enumerate(joining))
        stops = {t for r in joining for t in r.stop_ids}.difference(self.stop_ids.tolist())
        if stops:
            self.stop_ids = np.concatenate((self.stop_ids, list(stops))).astype(np.int64)

    def register_filled(self) -> None:
        """Offer the blocks the run's rows filled so far to the prefix cache (before a
        lookup, which must find them)."""
        if self.register_blocks:
            self.batch.offer_filled_blocks(self.kv)

    def _compact(self) -> None:
        """A new batch without the rows that left."""
        keep = np.ones(len(self.batch.reqs), bool)
        keep[self._leaving] = False
        for batch in (self.batch, *self._batches.values()):
            batch.lost = True
        self._leaving = []
        self.batch = self.batch.keep(keep, self._charger)
        self._index = {req: i for i, req in enumerate(self.batch.reqs)}

    # ---------------------------------------------------------------- results
    def owns(self, plan: StepPlan) -> bool:
        return self.active and plan.step_id in self._batches

    def apply(
        self, plan: StepPlan, tokens: np.ndarray, max_model_len: int, finish: Finish
    ) -> tuple[list[Request], int, StepPlan | None]:
        """Apply the run's rows of one step (its first rows): append their tokens, charge
        the service, end the rows whose token ends them. Returns the requests that got a
        token, how many tokens were wasted (their request had ended), and the rest of the
        step (the rows beside the run's, to apply in full; their tokens come after)."""
        batch = self._batches.pop(plan.step_id)
        k = len(batch.reqs)
        now = time.monotonic()
        tokens = tokens[:k]
        held = plan.starts[:k].astype(np.int64) + 2  # tokens each row holds now
        if not batch.lost and not self._leaving:
            reqs, limits, wasted = batch.reqs, batch.limit, 0
            deque(map(list.append, batch.outputs, tokens.tolist()), 0)
            deque(map(list.append, batch.token_times, repeat(now)), 0)
            batch.charge()
        else:  # rows left the run since this step was launched
            alive = [req.status is not RequestStatus.FINISHED for req in batch.reqs]
            mask = np.array(alive, bool)
            # Only a row whose last token this is can have left the run still running.
            last = np.flatnonzero(mask & (held >= batch.limit)).tolist()
            reqs, limits = batch.append_alive(alive, tokens[mask], now, self._index, last)
            if self.policy.charges_service:
                batch.charge(self.policy, ended=(~mask).tolist())
            tokens = tokens[mask]
            held = held[mask]
            wasted = len(alive) - len(reqs)
        ending = (held >= limits) | np.isin(tokens, self.stop_ids)
        for i in np.flatnonzero(ending).tolist():
            req, token = reqs[i], int(tokens[i])
            if req.finished:
                continue
            if (j := self._index.get(req)) is not None:
                self._sync(req, int(self.batch.computed[j]))  # its counters, for the stop check
            reason = check_stop(req, token, max_model_len)
            if reason is not None:
                finish(req, reason, token if reason is FinishReason.STOP else None)
        return reqs, wasted, None if k == len(plan.rows) else plan_beside_run(plan, k)
