"""How a step's rows are chosen among requests one by one: one token for each decode (in a
step short of blocks for them, which may preempt; other steps choose them over arrays,
``core/bulk_decodes.py``), and waiting requests admitted in the policy's order."""

from __future__ import annotations

import time
from collections.abc import Callable

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.ledger import ReleaseLedger
from async_engine.core.plan_builder import new_row
from async_engine.core.policy import Policy, StepShape
from async_engine.core.request import Request, RequestStatus
from streams.plan import NewRow

MakeRoom = Callable[[Request, int, list[tuple[Request, int]]], bool]


class RowChooser:
    def __init__(
        self,
        block_size: int,
        policy: Policy,
        kv: KVCacheManager,
        running: list[Request],
        ledger: ReleaseLedger,
        make_room: MakeRoom,
    ) -> None:
        self.block_size = block_size
        self.policy = policy
        self.kv = kv
        self.running = running  # the scheduler's list, shared
        self.ledger = ledger
        self.make_room = make_room  # preemption: blocks for a request, or False

    def decodes(
        self, reqs: list[Request], chosen: list[tuple[Request, int]], budget: int, preempt: bool
    ) -> tuple[int, list[Request]]:
        """Plan one token for each of ``reqs`` with one to feed, while the budget lasts;
        one short of blocks preempts another (``preempt``) or waits. Returns the budget
        left and the requests with more than one token to feed (prompt chunks).

        The hot loop: every running request, every step. Kept to plain arithmetic."""
        running = RequestStatus.RUNNING
        choose, charge, chunks = chosen.append, self.policy.charges_service, []
        for req in reqs:
            if budget == 0:
                break
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
            # Blocks for the token, past any draft slots still in flight (all may be kept).
            if self.kv.blocks_needed(req, 1) > 0 and not self.kv.allocate_slots(req, 1):
                if not preempt or not self.make_room(req, 1, chosen):
                    continue
            choose((req, 1))
            if charge and computed < len(req.prompt_ids):
                self.policy.charge_prompt(req, 1)  # a prompt's last token, left by a chunk
            budget -= 1
        return budget, chunks

    def admit(
        self,
        chosen: list[tuple[Request, int]],
        new_rows: list[NewRow],
        budget: int,
        shape: StepShape,
        first_tokens: bool,
    ) -> int:
        """Move waiting requests into the running set, in the policy's order, while budget,
        slots (``shape.max_running``) and blocks allow; returns the budget left."""
        policy, running = self.policy, self.running
        while budget > 0 and len(running) < shape.max_running:
            req = policy.next_waiting(len(running), first_tokens)
            if req is None:
                break
            if req.num_drafts_inflight:
                break  # preempted with drafts in flight: how many tokens it has comes first
            if req.num_computed_tokens == 0 and not req.block_ids:
                self.kv.lookup_prefix(req)
            pending = req.num_tokens + req.num_inflight
            n = 0 if pending >= req.token_limit else min(pending - req.num_computed_tokens, budget)
            if n == 0 or not self.kv.allocate_slots(req, n):
                self.kv.release(req)  # give back prefix-cache hits; retry next step
                self.kv.rows.set_computed(req, 0)
                break
            policy.admitted(req, n)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            if req.row is None:
                self.ledger.take_row(req)
                new_rows.append(new_row(req))
            running.append(req)
            chosen.append((req, n))
            budget -= n
        return budget
