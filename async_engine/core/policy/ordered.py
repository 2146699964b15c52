"""fcfs and priority: one queue, a hard limit of --max-num-seqs, no first-token steps."""

from __future__ import annotations

from async_engine.core.policy.base import Policy, StepShape
from async_engine.core.queues import WaitQueue
from async_engine.core.request import Request


class OrderedPolicy(Policy):
    """``fcfs`` admits in arrival order, ``priority`` by priority (lower first) then
    arrival. Every step has the whole budget."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, by_priority: bool) -> None:
        super().__init__(max_num_seqs, max_num_batched_tokens)
        self.by_priority = by_priority
        self.queue = WaitQueue(by_priority)
        self._shape = StepShape(max_num_batched_tokens, max_num_seqs)  # every step's

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    def add(self, req: Request) -> None:
        self.queue.push(req)

    def remove(self, req: Request) -> None:
        self.queue.remove(req)

    def step_shape(
        self,
        step_id: int,
        running: list[Request],
        compute_bound: bool,
        allow_first_tokens: bool = True,
    ) -> StepShape:
        return self._shape

    def next_waiting(self, num_running: int, first_tokens: bool) -> Request | None:
        return None if first_tokens else self.queue.peek()

    def admitted(self, req: Request, n: int) -> None:
        self.queue.pop()

    def victim(self, running: list[Request], planned: list[Request]) -> Request:
        """Lowest priority first (largest number), newest among equals: cheapest to redo;
        one not planned this step if there is one."""
        candidates = [r for r in running if r not in planned] or running
        if self.by_priority:
            return max(candidates, key=lambda r: (r.priority, r.arrival_seq))
        return max(candidates, key=lambda r: r.arrival_seq)
