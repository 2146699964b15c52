"""Steady decode: a run of decode steps planned and applied over arrays, not request by
request.

At a GPU's 1 ms steps and a batch of hundreds, touching every request twice a step in
Python is most of the control plane's time. Once a plan holds every running request with
one token each (their prompts done, nobody waiting, no logprobs wanted), a run starts:
each row's computed-token count lives in an array, the next plan is the last one shifted
by a token, and a step's tokens are appended to the requests' output lists in one pass of
C-level iteration. Only the rows that change go through Python: one that needs a new KV
block, one whose token may end it, one that leaves. The blocks a run's decodes fill are
offered to the prefix cache when their row leaves or the run stops, not as each fills:
nobody can look them up meanwhile (a run admits nobody), and hashing a block a step per
16 rows was most of a step's work at batch 256. A row leaves the run when its request ends, or once its last token is in
flight (it is planned no more; its last token is applied as the others' are). An arrival
ends the run (admission is the full scheduler's job), as does a preemption.

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
from dataclasses import dataclass
from itertools import compress, repeat

import numpy as np

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.policy import Policy
from async_engine.core.request import FinishReason, Request, RequestStatus
from async_engine.core.step_results import check_stop
from streams.plan import PLACEHOLDER, StepPlan

_EMPTY32 = np.zeros(0, np.int32)
Finish = Callable[[Request, FinishReason, int | None], None]


@dataclass(slots=True)
class Batch:
    """The run's rows at one time, in plan order; a row leaving makes a new one (plans in
    flight keep theirs)."""

    reqs: list[Request]
    outputs: list[list[int]]
    token_times: list[list[float]]
    limit: np.ndarray  # token_limit per row
    charge: Callable[[], None] | None  # the policy's output charge for these rows

    def keep(self, mask: np.ndarray, charge: Callable[[], None] | None) -> Batch:
        flags = mask.tolist()
        return Batch(
            list(compress(self.reqs, flags)),
            list(compress(self.outputs, flags)),
            list(compress(self.token_times, flags)),
            self.limit[mask],
            charge,
        )


class SteadyDecode:
    def __init__(self, kv: KVCacheManager, register_blocks: bool, policy: Policy) -> None:
        self.kv = kv
        self.policy = policy
        self.block_size = kv.block_size
        self.register_blocks = register_blocks
        self.active = False
        self._batches: dict[int, Batch] = {}  # the batch of each of the run's plans in flight

    @property
    def reqs(self) -> list[Request]:
        return self.batch.reqs

    # ------------------------------------------------------------ start, stop
    def try_start(self, plan: StepPlan, running: list[Request], no_waiting: bool) -> None:
        """Start a run after ``plan`` if it is steady: every running request, one token
        each, prompts done, nothing joining or starting over, no logprobs asked."""
        reqs = plan.requests
        if (
            self.active
            or not no_waiting
            or len(reqs) != len(running)
            or plan.num_tokens != len(reqs)
            or plan.new_rows
            or len(plan.reset_rows)
            or not plan.sample.all()
        ):
            return
        n = len(reqs)
        computed = plan.starts.astype(np.int64) + 1
        if (computed <= np.fromiter(map(len, (r.prompt_ids for r in reqs)), np.int64, n)).any():
            return  # a prompt's last token: its first token comes from this step
        if any(r.params.logprobs is not None for r in reqs):
            return
        self.active = True
        self._last_step_id = plan.step_id
        self._index = {req: i for i, req in enumerate(reqs)}
        self._leaving: list[int] = []
        self.rows = plan.rows
        self.computed = computed
        bs = self.block_size
        self.capacity = np.fromiter((len(r.block_ids) * bs for r in reqs), np.int64, n)
        stops = {t for r in reqs for t in r.stop_ids}
        self.stop_ids = np.fromiter(stops, np.int64, len(stops))
        self.batch = Batch(
            reqs,
            [r.output_ids for r in reqs],
            [r.token_times for r in reqs],
            np.fromiter((r.token_limit for r in reqs), np.int64, n),
            self._charger(reqs),
        )

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
            self._sync(req, int(self.computed[i]))

    def leave(self, req: Request) -> None:
        """``req`` ended: its row leaves the run (at the next plan), its fields up to date."""
        i = self._index.pop(req, None)
        if i is not None:
            self._sync(req, int(self.computed[i]))
            self._leaving.append(i)
        if self.register_blocks:
            self.kv.register_full_blocks(req)

    def _sync(self, req: Request, computed: int) -> None:
        req.num_tokens = len(req.prompt_ids) + len(req.output_ids)
        req.num_computed_tokens = computed
        req.num_inflight = computed + 1 - req.num_tokens
        req.last_launched_step = self._last_step_id

    def _charger(self, reqs: list[Request]) -> Callable[[], None] | None:
        return self.policy.output_charger(reqs) if self.policy.charges_service else None

    # ----------------------------------------------------------------- plans
    def plan(self, step_id: int, released_rows: Callable[[], list[int]]) -> StepPlan | None:
        """The run's next plan; None where the run cannot go on (nobody left, or a row's
        new block is not to be had): then ``stop`` and plan in full."""
        done = self.computed + 1 >= self.batch.limit  # their last token is in flight
        if done.any():
            for i in np.flatnonzero(done).tolist():
                req = self.batch.reqs[i]
                if self._index.pop(req, None) is not None:
                    self._sync(req, int(self.computed[i]))
                    self._leaving.append(i)
                    if self.register_blocks:
                        self.kv.register_full_blocks(req)
        if self._leaving:
            self._compact()
        if not self.batch.reqs:
            return None
        computed = self.computed
        growing = np.flatnonzero(computed >= self.capacity).tolist()  # at a block's first slot
        for i in growing:
            req = self.batch.reqs[i]
            self._sync(req, int(computed[i]))
            if not self.kv.allocate_slots(req, 1):
                return None  # blocks taken so far are sent by the full plan
        new_blocks: list[int] = []
        for i in growing:
            req, row = self.batch.reqs[i], int(self.rows[i])
            for block in req.block_ids[req.num_sent_blocks :]:
                new_blocks += (row, block)
            req.num_sent_blocks = len(req.block_ids)
            self.capacity[i] = len(req.block_ids) * self.block_size
        starts = computed.astype(np.int32)
        computed += 1
        self._last_step_id = step_id
        self._batches[step_id] = self.batch
        n = len(starts)
        return StepPlan(
            step_id=step_id,
            rows=self.rows,
            starts=starts,
            query_lens=np.ones(n, np.int32),
            sample=np.ones(n, bool),
            input_ids=np.full(n, PLACEHOLDER, np.int64),
            released_rows=np.array(released_rows(), np.int32),
            new_blocks=np.array(new_blocks, np.int32) if new_blocks else _EMPTY32,
            requests=self.batch.reqs,
        )

    def _compact(self) -> None:
        keep = np.ones(len(self.batch.reqs), bool)
        keep[self._leaving] = False
        self._leaving = []
        reqs = list(compress(self.batch.reqs, keep.tolist()))
        self.batch = self.batch.keep(keep, self._charger(reqs))
        self.rows = self.rows[keep]
        self.computed = self.computed[keep]
        self.capacity = self.capacity[keep]
        self._index = {req: i for i, req in enumerate(self.batch.reqs)}

    # ---------------------------------------------------------------- results
    def owns(self, plan: StepPlan) -> bool:
        return self.active and plan.step_id in self._batches

    def apply(
        self, plan: StepPlan, tokens: np.ndarray, max_model_len: int, finish: Finish
    ) -> tuple[list[Request], int]:
        """Apply one of the run's steps: append its tokens, register blocks just filled,
        charge the service, end the rows whose token ends them. Returns the requests that
        got a token and how many tokens were wasted (their request had ended)."""
        batch = self._batches.pop(plan.step_id)
        now = time.monotonic()
        held = plan.starts.astype(np.int64) + 2  # tokens each row holds now
        if batch is self.batch and not self._leaving:
            reqs, limits, wasted = batch.reqs, batch.limit, 0
            deque(map(list.append, batch.outputs, tokens.tolist()), 0)
            deque(map(list.append, batch.token_times, repeat(now)), 0)
            if batch.charge is not None:
                batch.charge()
        else:  # rows left the run since this step was launched
            alive = [req.status is not RequestStatus.FINISHED for req in batch.reqs]
            mask = np.array(alive, bool)
            reqs, limits, tokens = self._apply_left(batch, alive, tokens[mask], now)
            held = held[mask]
            wasted = len(alive) - len(reqs)
        ending = (held >= limits) | np.isin(tokens, self.stop_ids)
        for i in np.flatnonzero(ending).tolist():
            req, token = reqs[i], int(tokens[i])
            if req.finished:
                continue
            if (j := self._index.get(req)) is not None:
                self._sync(req, int(self.computed[j]))  # its counters, for the stop check
            reason = check_stop(req, token, max_model_len)
            if reason is not None:
                finish(req, reason, token if reason is FinishReason.STOP else None)
        return reqs, wasted

    def _apply_left(
        self, batch: Batch, alive: list[bool], tokens: np.ndarray, now: float
    ) -> tuple[list[Request], np.ndarray, np.ndarray]:
        """A step whose batch lost rows since: an ended request's token is wasted; one that
        left with its last token in flight keeps its own counters, so they move here."""
        reqs = list(compress(batch.reqs, alive))
        deque(map(list.append, compress(batch.outputs, alive), tokens.tolist()), 0)
        deque(map(list.append, compress(batch.token_times, alive), repeat(now)), 0)
        for req in reqs:
            if req not in self._index:
                req.num_tokens += 1
                req.num_inflight -= 1
        if self.policy.charges_service:
            self.policy.charge_output(reqs)
        return reqs, batch.limit[np.array(alive, bool)], tokens
