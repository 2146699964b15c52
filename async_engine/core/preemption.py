"""Preemption: a running request gives its KV blocks back so that another can run.

The victim (the policy's choice) keeps its row and its output; it waits again and is
computed afresh from its prompt and output when readmitted, its device table starting
over. Its blocks return once the steps in flight that use them have completed.
"""

from __future__ import annotations

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.ledger import ReleaseLedger
from async_engine.core.policy import Policy
from async_engine.core.request import Request, RequestStatus


class Preemption:
    def __init__(
        self,
        running: list[Request],
        policy: Policy,
        kv: KVCacheManager,
        ledger: ReleaseLedger,
    ) -> None:
        self.running = running  # the scheduler's list, shared
        self.policy = policy
        self.kv = kv
        self.ledger = ledger
        self.count = 0  # preemptions, lifetime

    def make_room(self, req: Request, n: int, chosen: list[tuple[Request, int]]) -> bool:
        """Preempt until ``req`` gets blocks for ``n`` more tokens; False if it cannot run
        this step (it may be the victim itself). ``chosen``: the step's plan so far."""
        while True:
            needed = self.kv.blocks_needed(req, n) - self.kv.pool.num_free
            if self.ledger.blocks_arriving() >= needed:
                return False  # blocks of ended requests come back after the running step
            victim = self.policy.victim(self.running, [r for r, _ in chosen])
            self.preempt(victim)
            if victim is req:
                return False
            if self.kv.allocate_slots(req, n):
                return True

    def preempt(self, req: Request) -> None:
        if self.kv.pool.enable_prefix_cache:
            self.kv.register_full_blocks(req)  # so that its readmission finds them
        self.running.remove(req)
        self.policy.left_running(req)
        req.status = RequestStatus.WAITING
        self.kv.rows.set_computed(req, 0)
        req.num_preemptions += 1
        self.count += 1
        self.ledger.free_after_launch(req)
        req.table_reset = True  # it keeps its row; the device's table starts over
        req.num_sent_blocks = 0
        self.policy.add(req)
