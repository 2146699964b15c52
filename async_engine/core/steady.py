"""Steady decode: a run of steps that admit, stop and preempt nobody, planned and applied
over arrays instead of request by request.

At a GPU's 1 ms steps and a batch of hundreds, touching every request twice a step in
Python is most of the control plane's time. Once a plan holds every running request with
one token each (their prompts done, nobody waiting, no logprobs wanted), the run starts:
each row's computed-token count lives in an array, the next plan is the last one shifted
by a token, and a step's result is appended to the requests' output lists in one pass of
C-level iteration. Only the rows that change go through Python: one that needs a new KV
block, one whose newest block fills (the prefix cache), one whose token may end it.

While a run lasts, four request fields are not kept up to date: ``num_computed_tokens``,
``num_inflight``, ``num_tokens`` and ``last_launched_step``. ``stop`` writes them back and
ends the run; the scheduler calls it before anything else reads or changes a running
request (a stop, an abort, an arrival, a lost device, a metrics scrape).

Invariant of a run, per row: the tokens it has to feed are exactly one, so after each
launch ``num_tokens + num_inflight == computed + 1``, and once step P (which computed
position ``starts[i]``) is applied the row holds ``starts[i] + 2`` tokens.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from itertools import repeat

import numpy as np

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.policy import Policy
from async_engine.core.request import FinishReason, Request
from async_engine.core.step_results import check_stop
from streams.plan import PLACEHOLDER, StepPlan

_EMPTY32 = np.zeros(0, np.int32)


class SteadyDecode:
    def __init__(self, kv: KVCacheManager, register_blocks: bool, policy: Policy) -> None:
        self.kv = kv
        self.policy = policy
        self.block_size = kv.block_size
        self.register_blocks = register_blocks
        self.active = False
        self.first_step_id = 0  # the run's first plan: every later plan applied is the run's
        self._last_step_id = -1

    # ------------------------------------------------------------------ a run
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
        prompt_lens = np.fromiter(map(len, (r.prompt_ids for r in reqs)), np.int64, len(reqs))
        computed = plan.starts.astype(np.int64) + 1
        if (computed <= prompt_lens).any():
            return  # a prompt's last token: its first token comes from this step
        if any(r.params.logprobs is not None for r in reqs):
            return
        self.active = True
        self.reqs = reqs  # the run's batch order; never mutated (plans keep it)
        self.first_step_id = plan.step_id + 1
        self._last_step_id = plan.step_id
        self.rows = plan.rows
        self.computed = computed
        bs = self.block_size
        self.capacity = np.fromiter((len(r.block_ids) * bs for r in reqs), np.int64, len(reqs))
        self.limit = np.fromiter((r.token_limit for r in reqs), np.int64, len(reqs))
        self.num_hashes = np.fromiter((len(r.block_hashes) for r in reqs), np.int64, len(reqs))
        stops = {t for r in reqs for t in r.stop_ids}
        self.stop_ids = np.fromiter(stops, np.int64, len(stops))
        self.outputs = [r.output_ids for r in reqs]
        self.token_times = [r.token_times for r in reqs]
        self._ones = np.ones(len(reqs), np.int32)
        self._all = np.ones(len(reqs), bool)
        self._placeholders = np.full(len(reqs), PLACEHOLDER, np.int64)
        self._charge = self.policy.output_charger(reqs) if self.policy.charges_service else None

    def stop(self) -> None:
        """End the run: write the request fields it kept in arrays back."""
        if not self.active:
            return
        self.active = False
        for req, computed in zip(self.reqs, self.computed.tolist(), strict=True):
            self._sync(req, computed)

    def sync_row(self, i: int) -> Request:
        req = self.reqs[i]
        self._sync(req, int(self.computed[i]))
        return req

    def _sync(self, req: Request, computed: int) -> None:
        req.num_tokens = len(req.prompt_ids) + len(req.output_ids)
        req.num_computed_tokens = computed
        req.num_inflight = computed + 1 - req.num_tokens
        req.last_launched_step = self._last_step_id

    # ----------------------------------------------------------------- plans
    def plan(self, step_id: int, released_rows: Callable[[], list[int]]) -> StepPlan | None:
        """The run's next plan; None where it cannot be steady (a row's last token is in
        flight, or a row's new block is not to be had): then ``stop`` and plan in full."""
        computed = self.computed
        if (computed + 1 >= self.limit).any():
            return None
        growing = np.flatnonzero(computed >= self.capacity).tolist()  # at a block's first slot
        for i in growing:
            if not self.kv.allocate_slots(self.sync_row(i), 1):
                return None  # blocks taken so far are sent by the full plan
        new_blocks: list[int] = []
        for i in growing:
            req, row = self.reqs[i], int(self.rows[i])
            for block in req.block_ids[req.num_sent_blocks :]:
                new_blocks += (row, block)
            req.num_sent_blocks = len(req.block_ids)
            self.capacity[i] = len(req.block_ids) * self.block_size
        starts = computed.astype(np.int32)
        computed += 1
        self._last_step_id = step_id
        return StepPlan(
            step_id=step_id,
            rows=self.rows,
            starts=starts,
            query_lens=self._ones,
            sample=self._all,
            input_ids=self._placeholders,
            released_rows=np.array(released_rows(), np.int32),
            new_blocks=np.array(new_blocks, np.int32) if new_blocks else _EMPTY32,
            requests=self.reqs,
        )

    # ---------------------------------------------------------------- results
    def owns(self, plan: StepPlan) -> bool:
        return self.active and plan.step_id >= self.first_step_id

    def apply(
        self,
        plan: StepPlan,
        tokens: np.ndarray,
        max_model_len: int,
        finish: Callable[[Request, FinishReason, int | None], None],
    ) -> list[Request]:
        """Apply one of the run's steps: append its tokens, register blocks just filled,
        charge the service; a row whose token may end it (a stop id, its token limit) ends
        the run and is checked in full. Returns the requests that got a token."""
        now = time.monotonic()
        deque(map(list.append, self.outputs, tokens.tolist()), 0)
        deque(map(list.append, self.token_times, repeat(now)), 0)
        held = plan.starts.astype(np.int64) + 2  # tokens each row holds now
        if self.register_blocks:
            known = np.minimum(held, self.computed)
            filled = np.flatnonzero(known // self.block_size > self.num_hashes).tolist()
            for i in filled:
                req = self.reqs[i]
                self.kv.register_full_blocks(req, int(known[i]))
                self.num_hashes[i] = len(req.block_hashes)
        if self._charge is not None:
            self._charge()
        ending = (held >= self.limit) | np.isin(tokens, self.stop_ids)
        if ending.any():
            self.stop()
            for i in np.flatnonzero(ending).tolist():
                req, token = plan.requests[i], int(tokens[i])
                reason = check_stop(req, token, max_model_len)
                if reason is not None:
                    finish(req, reason, token if reason is FinishReason.STOP else None)
        return plan.requests
