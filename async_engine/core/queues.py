"""The waiting queue's order: which request is admitted next, and who is preempted first.

``fcfs`` admits in arrival order, ``priority`` by priority (lower first) then arrival, and
``fair`` shares the device between tenants with Virtual Token Counters (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024): each tenant's counter grows by
the service it receives (a price per prompt token computed and per token generated,
divided by the tenant's weight); the backlogged tenant with the smallest counter is
admitted next, and within a tenant priority then arrival order rule. A tenant that
returns from idle has its counter lifted to the smallest backlogged counter (or, with
nobody waiting, to the largest running one), so nobody banks credit by idling. Idle
tenants' entries are evicted past ``max_tenants``: a lifted newcomer loses nothing.

Counters order admission; they do not say how soon an admitted request runs. So the fair
queue also tells the scheduler when a tenant is behind in the batch (``next_behind``,
``contended``): under its share of the slots while another tenant holds more, or, asking
for no more than its share (light), while a tenant asking for more has prompts to
compute, which would take the step. The scheduler then gives a light tenant's requests a
step of their own for their first token, and lets a full batch take any tenant behind.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from async_engine.core.request import Request

POLICIES = ("fcfs", "priority", "fair")
PROMPT_PRICE = 1.0  # per prompt token computed
OUTPUT_PRICE = 2.0  # per token generated (the paper's prices)


class WaitQueue(Protocol):
    """Contract of a waiting queue. ``charges``: the scheduler reports service to it."""

    charges: bool

    def push(self, req: Request) -> None: ...
    def peek(self) -> Request | None: ...
    def pop(self, head: Request) -> None:
        """Take ``head``, what ``peek`` or ``next_behind`` just returned, off the queue."""
        ...

    def remove(self, req: Request) -> None: ...
    def __len__(self) -> int: ...
    def victim(self, running: list[Request], planned: list[Request]) -> Request:
        """Whom to preempt among ``running``; ``planned`` already has tokens this step."""
        ...

    def stopped_running(self, req: Request) -> None: ...
    def next_behind(self, slots: int, prefilling: set[str], light: bool) -> Request | None:
        """The next request, in counter order, of a tenant behind in the batch: none of its
        prompts mid-prefill (``prefilling``: the names of tenants with one), it runs fewer
        than its weighted share of ``slots``, and another tenant runs more (per weight).
        A light tenant, one asking for no more than its share, is behind also while a
        tenant asking for more has prompts to compute. ``light``: light tenants only."""
        ...

    def contended(self, slots: int, prefilling: set[str]) -> bool:
        """Whether a light tenant with work is behind in the batch (see ``next_behind``)."""
        ...


class OrderedQueue:
    """fcfs or priority: one heap."""

    charges = False

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._heap: list[tuple[int, int, Request]] = []

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority if self.by_priority else 0, req.arrival_seq, req))

    def peek(self) -> Request | None:
        return self._heap[0][2] if self._heap else None

    def pop(self, head: Request) -> None:
        heapq.heappop(self._heap)

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[2] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def stopped_running(self, req: Request) -> None:
        pass

    def next_behind(self, slots: int, prefilling: set[str], light: bool) -> Request | None:
        return None  # no tenants here: admission order is all there is

    def contended(self, slots: int, prefilling: set[str]) -> bool:
        return False

    def victim(self, running: list[Request], planned: list[Request]) -> Request:
        """Lowest priority first (largest number), newest among equals: cheapest to redo;
        one not planned this step if there is one."""
        candidates = [r for r in running if r not in planned] or running
        if self.by_priority:
            return max(candidates, key=lambda r: (r.priority, r.arrival_seq))
        return max(candidates, key=lambda r: r.arrival_seq)


@dataclass(slots=True)
class Tenant:
    name: str
    weight: float
    counter: float = 0.0  # weighted service received (the virtual token counter)
    running: int = 0
    waiting: list[tuple[int, int, Request]] = field(default_factory=list)  # heap
    prompt_cost: float = PROMPT_PRICE  # per token, over the weight
    output_cost: float = OUTPUT_PRICE


class FairQueue:
    charges = True

    def __init__(
        self,
        weights: dict[str, float] | None = None,
        default_weight: float = 1.0,
        max_tenants: int = 4096,
    ) -> None:
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self.max_tenants = max_tenants
        self.tenants: dict[str, Tenant] = {}
        self._backlogged: dict[str, Tenant] = {}  # tenants with waiting requests
        self._running: dict[str, Tenant] = {}  # tenants with running requests
        self._idle: OrderedDict[str, None] = OrderedDict()  # neither waiting nor running, LRU
        self._size = 0

    # --------------------------------------------------------------- tenants
    def tenant(self, name: str) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            weight = self.weights.get(name, self.default_weight)
            t = Tenant(name, weight, prompt_cost=PROMPT_PRICE / weight,
                       output_cost=OUTPUT_PRICE / weight)  # fmt: skip
            self.tenants[name] = t
            self._idle[name] = None
            self._evict()
        return t

    def _evict(self) -> None:
        while len(self.tenants) > self.max_tenants and self._idle:
            name, _ = self._idle.popitem(last=False)
            del self.tenants[name]

    def _touch(self, t: Tenant) -> None:
        """Keep the idle list true after t's waiting or running count changed."""
        if t.waiting or t.running:
            self._idle.pop(t.name, None)
        else:
            self._idle[t.name] = None
            self._idle.move_to_end(t.name)
            self._evict()

    # ----------------------------------------------------------------- queue
    def push(self, req: Request) -> None:
        t = req.tenant_state
        if t is None or self.tenants.get(t.name) is not t:
            t = req.tenant_state = self.tenant(req.tenant)
        if not t.waiting:
            self._lift(t)
            self._backlogged[t.name] = t
        heapq.heappush(t.waiting, (req.priority, req.arrival_seq, req))
        self._size += 1
        self._touch(t)

    def _lift(self, t: Tenant) -> None:
        if self._backlogged:
            floor = min(other.counter for other in self._backlogged.values())
        else:
            floor = max((o.counter for o in self.tenants.values() if o.running), default=0.0)
        t.counter = max(t.counter, floor)

    def peek(self) -> Request | None:
        if not self._backlogged:
            return None
        return min(self._backlogged.values(), key=self._order).waiting[0][2]

    @staticmethod
    def _order(t: Tenant) -> tuple[float, float, int]:
        """Smallest counter first; ties (a tenant lifted to another's counter) go to the
        lighter tenant: less running per weight, then fewer waiting."""
        return t.counter, t.running / t.weight, len(t.waiting)

    def next_behind(self, slots: int, prefilling: set[str], light: bool) -> Request | None:
        if not self._backlogged or not self._running:
            return None
        # Not only the head: a tenant whose counter a burst's last chunk has not yet passed
        # still goes before that burst's next chunk (which is no admission: counters order
        # admissions). Being behind bounds what it can take to its share of the slots.
        behind = self._behind(slots, prefilling, light)
        tenants = [t for t in self._backlogged.values() if behind(t)]
        if not tenants:
            return None
        return min(tenants, key=self._order).waiting[0][2]

    def contended(self, slots: int, prefilling: set[str]) -> bool:
        if not self._running:
            return False
        behind = self._behind(slots, prefilling, light=True)
        return any(map(behind, self._running.values())) or any(
            map(behind, self._backlogged.values())
        )

    def _behind(self, slots: int, prefilling: set[str], light: bool) -> Callable[[Tenant], bool]:
        """See ``next_behind``. A burst admits a request per prefill chunk, so until its
        prompts are computed it may run no more than a light tenant: counting slots alone,
        the light tenant's prompts would each wait behind a chunk of the burst's."""
        waiting_only = sum(t.weight for t in self._backlogged.values() if not t.running)
        per_weight = slots / (sum(t.weight for t in self._running.values()) + waiting_only)
        top = max(t.running / t.weight for t in self._running.values())

        def asks_over_share(t: Tenant | None) -> bool:
            return t is not None and t.running + len(t.waiting) > t.weight * per_weight

        burst = any(map(asks_over_share, self._backlogged.values())) or any(
            map(asks_over_share, map(self.tenants.get, prefilling))
        )

        def behind(t: Tenant) -> bool:
            share = t.weight * per_weight
            if t.running >= share or t.name in prefilling:
                return False
            runs_less = t.running / t.weight < top
            if t.running + len(t.waiting) <= share:  # a light tenant
                return runs_less or burst
            return runs_less and not light

        return behind

    def pop(self, head: Request) -> None:
        t = head.tenant_state
        heapq.heappop(t.waiting)
        self._size -= 1
        if not t.waiting:
            del self._backlogged[t.name]
        t.running += 1
        self._running[t.name] = t
        self._touch(t)

    def remove(self, req: Request) -> None:
        t = req.tenant_state
        if t is None:
            return
        before = len(t.waiting)
        t.waiting = [e for e in t.waiting if e[2] is not req]
        heapq.heapify(t.waiting)
        self._size -= before - len(t.waiting)
        if not t.waiting:
            self._backlogged.pop(t.name, None)
        self._touch(t)

    def stopped_running(self, req: Request) -> None:
        """``req`` left the running set (finished or preempted)."""
        t = req.tenant_state
        if t is not None and t.running > 0:
            t.running -= 1
            if not t.running:
                del self._running[t.name]
            self._touch(t)

    def __len__(self) -> int:
        return self._size

    def victim(self, running: list[Request], planned: list[Request]) -> Request:
        """From the tenant furthest over its share, planned this step or not; lowest
        priority, newest, within it."""
        return max(running, key=lambda r: (r.tenant_state.counter if r.tenant_state else 0.0,
                                              r.priority, r.arrival_seq))  # fmt: skip


def make_queue(
    policy: str, weights: dict[str, float] | None = None, default_weight: float = 1.0
) -> OrderedQueue | FairQueue:
    if policy == "fair":
        return FairQueue(weights, default_weight)
    if policy in ("fcfs", "priority"):
        return OrderedQueue(by_priority=policy == "priority")
    raise ValueError(f"scheduling_policy must be {'|'.join(POLICIES)}, got {policy!r}")
