"""The rows of a steady decode run (``core/steady.py``): its batch at one time, and the
pieces of one step's plan."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from itertools import compress, repeat

import numpy as np

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.policy import Policy
from async_engine.core.request import Request, RequestStatus
from streams.plan import StepPlan

Charger = Callable[[list[Request], int], tuple[Callable[[], None], ...]]
# A batch's charges grow by one as rows leave (their charge taken back); past this many,
# the batch gets one charge again, worked out over its rows.
MAX_CHARGERS = 8


@dataclass(slots=True)
class Batch:
    """The run's rows at one time, in plan order. A row leaving or joining makes a new
    batch: the plans in flight keep theirs (their lists and limits; ``computed`` and
    ``capacity`` move with the run only)."""

    reqs: list[Request]
    outputs: list[list[int]]
    token_times: list[list[float]]
    limit: np.ndarray  # token_limit per row
    # The policy's output charges for these rows, one per group that joined (worked out
    # once per group, not per step).
    charges: tuple[Callable[[], None], ...]
    rows: np.ndarray  # the device rows
    computed: np.ndarray  # num_computed_tokens, kept here while the run lasts
    capacity: np.ndarray  # KV slots in the row's blocks
    prompt_lens: np.ndarray
    num_hashes: np.ndarray  # blocks of the row offered to the prefix cache
    lost: bool = False  # a row of it left the run since: its plans check each row

    @classmethod
    def of(
        cls,
        reqs: list[Request],
        rows: np.ndarray,
        block_size: int,
        charges: tuple[Callable[[], None], ...],
    ) -> Batch:
        n = len(reqs)

        def column(values: Iterable[int]) -> np.ndarray:
            return np.fromiter(values, np.int64, n)

        return cls(
            reqs,
            [r.output_ids for r in reqs],
            [r.token_times for r in reqs],
            column(r.token_limit for r in reqs),
            charges,
            rows,
            column(r.num_computed_tokens for r in reqs),
            column(len(r.block_ids) * block_size for r in reqs),
            column(len(r.prompt_ids) for r in reqs),
            column(len(r.block_hashes) for r in reqs),
        )

    def keep(self, mask: np.ndarray, charger: Charger) -> Batch:
        """The rows of ``mask``; ``charger(reqs, tokens)`` gives the charges of ``reqs``."""
        flags = mask.tolist()
        if len(self.charges) < MAX_CHARGERS:  # take the rows that left back off the charge
            charges = self.charges + charger(list(compress(self.reqs, (~mask).tolist())), -1)
        else:  # one charge for the batch again
            charges = charger(list(compress(self.reqs, flags)), 1)
        return Batch(
            list(compress(self.reqs, flags)),
            list(compress(self.outputs, flags)),
            list(compress(self.token_times, flags)),
            self.limit[mask],
            charges,
            self.rows[mask],
            self.computed[mask],
            self.capacity[mask],
            self.prompt_lens[mask],
            self.num_hashes[mask],
        )

    def extend(self, other: Batch) -> Batch:
        return Batch(
            self.reqs + other.reqs,
            self.outputs + other.outputs,
            self.token_times + other.token_times,
            np.concatenate((self.limit, other.limit)),
            self.charges + other.charges,
            np.concatenate((self.rows, other.rows)),
            np.concatenate((self.computed, other.computed)),
            np.concatenate((self.capacity, other.capacity)),
            np.concatenate((self.prompt_lens, other.prompt_lens)),
            np.concatenate((self.num_hashes, other.num_hashes)),
        )

    def charge(self, policy: Policy | None = None, ended: list[bool] | None = None) -> None:
        """Charge a step's output: every row, less the rows ``ended`` (few) taken back."""
        for charge in self.charges:
            charge()
        if ended is not None and policy is not None and any(ended):
            policy.charge_output(list(compress(self.reqs, ended)), -1)

    def offer_filled_blocks(self, kv: KVCacheManager) -> None:
        """Offer the blocks the rows filled so far to the prefix cache: as many tokens as
        are both held and computed."""
        held = self.prompt_lens + np.fromiter(map(len, self.outputs), np.int64, len(self.reqs))
        known = np.minimum(held, self.computed)
        for i in np.flatnonzero(known // kv.block_size > self.num_hashes).tolist():
            req = self.reqs[i]
            kv.register_full_blocks(req, int(known[i]))
            self.num_hashes[i] = len(req.block_hashes)

    def append_alive(
        self,
        alive: list[bool],
        tokens: np.ndarray,
        now: float,
        in_run: Container[Request],
        last: list[int],
    ) -> tuple[list[Request], np.ndarray]:
        """A step of this batch after rows left the run: the still running rows take their
        ``tokens``; one no longer ``in_run`` (its last token was in flight; it is among the
        rows ``last``) moves its own counters. Returns those requests and their limits."""
        reqs = list(compress(self.reqs, alive))
        deque(map(list.append, compress(self.outputs, alive), tokens.tolist()), 0)
        deque(map(list.append, compress(self.token_times, alive), repeat(now)), 0)
        for i in last:
            req = self.reqs[i]
            if req not in in_run:
                req.num_tokens += 1
                req.num_inflight -= 1
        return reqs, self.limit[np.array(alive, bool)]


@dataclass(slots=True)
class RunPart:
    """The run's rows of one step: the batch they are in, their starts, new blocks."""

    batch: Batch
    starts: np.ndarray
    new_blocks: list[int]


def joinable(req: Request, start: int, size: int, sampled: bool) -> bool:
    """Planned one sampled token past its prompt, with no logprobs, and still running."""
    return (
        size == 1
        and bool(sampled)
        and start >= len(req.prompt_ids)
        and req.params.logprobs is None
        and req.status is RequestStatus.RUNNING
    )


def plan_beside_run(plan: StepPlan, k: int) -> StepPlan:
    """The rows of a step after the run's first ``k``, to apply in full (``merge_plans``
    undone; tokens are the caller's, so no input ids)."""
    return StepPlan(
        plan.step_id,
        plan.rows[k:],
        plan.starts[k:],
        plan.query_lens[k:],
        plan.sample[k:],
        plan.input_ids[:0],
        requests=plan.requests[k:],
    )


def merge_plans(run: StepPlan, rest: StepPlan) -> StepPlan:
    """One step's plan: the run's rows, then the rest's (which brings new, reset rows)."""
    return StepPlan(
        step_id=run.step_id,
        rows=np.concatenate((run.rows, rest.rows)),
        starts=np.concatenate((run.starts, rest.starts)),
        query_lens=np.concatenate((run.query_lens, rest.query_lens)),
        sample=np.concatenate((run.sample, rest.sample)),
        input_ids=np.concatenate((run.input_ids, rest.input_ids)),
        new_rows=rest.new_rows,
        released_rows=run.released_rows,
        reset_rows=rest.reset_rows,
        new_blocks=np.concatenate((run.new_blocks, rest.new_blocks)).astype(np.int32),
        requests=run.requests + rest.requests,
    )
