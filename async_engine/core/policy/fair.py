"""``fair``: tenants share the device by weight, with Virtual Token Counters (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024).

Each tenant's counter grows by the service it receives (a price per prompt token computed
and per token generated, divided by the tenant's weight); the backlogged tenant with the
smallest counter is admitted next, and within a tenant priority then arrival order rule.
A tenant that returns from idle has its counter lifted to the smallest backlogged counter
(or, with nobody waiting, to the largest running one), so nobody banks credit by idling.
Idle tenants' entries are evicted past ``max_tenants``: a lifted newcomer loses nothing.

Counters order admissions; they do not say how soon an admitted request runs. So the
policy also shapes steps for a tenant *behind in the batch*: under its share of the slots
while another tenant holds more, or, asking for no more than its share (light), while a
tenant asking for more has prompts to compute, which would take the step. A light tenant
behind gets a first-token step (its prompts and no other tenant's prefill chunk), goes
before the others' chunks in the other steps, and a full batch takes any tenant behind up
to ``overflow_seqs`` more. The tuned numbers and what they were measured to do are in
``FairTuning``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from async_engine.core.policy.base import Policy, StepShape
from async_engine.core.policy.tenants import FairTuning, Tenant, default_overflow_seqs
from async_engine.core.request import Request


class FairPolicy(Policy):
    charges_service = True

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        weights: dict[str, float] | None = None,
        default_weight: float = 1.0,
        overflow_seqs: int | None = None,
        max_tenants: int = 4096,
        tuning: FairTuning | None = None,
    ) -> None:
        super().__init__(max_num_seqs, max_num_batched_tokens)
        self.tuning = tuning = tuning or FairTuning()
        if overflow_seqs is None:
            overflow_seqs = default_overflow_seqs(max_num_seqs, tuning)
        self.overflow_seqs = overflow_seqs
        self.max_running = max_num_seqs + overflow_seqs
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self.max_tenants = max_tenants
        self.tenants: dict[str, Tenant] = {}
        self._backlogged: dict[str, Tenant] = {}  # tenants with waiting requests
        self._running: dict[str, Tenant] = {}  # tenants with running requests
        self._idle: OrderedDict[str, None] = OrderedDict()  # neither waiting nor running, LRU
        self._size = 0
        self._last_first_token_step: int | None = None  # None: no first-token step yet
        # Tenants with a running prompt not yet planned to its end, as of the step shaped.
        self._prefilling: set[str] | frozenset[str] = frozenset()
        self._full_step = StepShape(max_num_batched_tokens, self.max_running)

    # --------------------------------------------------------------- tenants
    def tenant(self, name: str) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            t = Tenant.weighted(name, self.weights.get(name, self.default_weight))
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
        if t.queue or t.running:
            self._idle.pop(t.name, None)
        else:
            self._idle[t.name] = None
            self._idle.move_to_end(t.name)
            self._evict()

    def _lift(self, t: Tenant) -> None:
        if self._backlogged:
            floor = min(other.counter for other in self._backlogged.values())
        else:
            floor = max((o.counter for o in self.tenants.values() if o.running), default=0.0)
        t.counter = max(t.counter, floor)

    @staticmethod
    def _order(t: Tenant) -> tuple[float, float, int]:
        """Smallest counter first; ties (a tenant lifted to another's counter) go to the
        lighter tenant: less running per weight, then fewer waiting."""
        return t.counter, t.running / t.weight, len(t.queue)

    # ------------------------------------------------------- waiting requests
    @property
    def num_waiting(self) -> int:
        return self._size

    def add(self, req: Request) -> None:
        t = self.tenant(req.tenant)
        if not t.queue:
            self._lift(t)
            self._backlogged[t.name] = t
        t.queue.push(req)
        self._size += 1
        self._touch(t)

    def remove(self, req: Request) -> None:
        t = self.tenants.get(req.tenant)
        if t is None or not t.queue.remove(req):
            return
        self._size -= 1
        if not t.queue:
            self._backlogged.pop(t.name, None)
        self._touch(t)

    def next_waiting(self, num_running: int, first_tokens: bool) -> Request | None:
        if first_tokens or num_running >= self.max_num_seqs:
            # A full batch still takes a tenant behind (up to the overflow the scheduler
            # enforces): otherwise one tenant's burst holds every slot until it ends.
            return self._next_behind(light=first_tokens)
        if not self._backlogged:
            return None
        return min(self._backlogged.values(), key=self._order).queue.peek()

    def admitted(self, req: Request, n: int) -> None:
        t = self.tenants[req.tenant]
        t.queue.pop()
        self._size -= 1
        if not t.queue:
            del self._backlogged[t.name]
        t.running += 1
        self._running[t.name] = t
        self._touch(t)
        # At once: the next admission's order depends on it.
        self.charge_prompt(req, n)

    def left_running(self, req: Request) -> None:
        t = self.tenants.get(req.tenant)
        if t is not None and t.running > 0:
            t.running -= 1
            if not t.running:
                del self._running[t.name]
            self._touch(t)

    def victim(self, running: list[Request], planned: list[Request]) -> Request:
        """From the tenant furthest over its share, planned this step or not; lowest
        priority, newest, within it."""
        tenants = self.tenants

        def key(r: Request) -> tuple[float, int, int]:
            t = tenants.get(r.tenant)
            return (t.counter if t is not None else 0.0), r.priority, r.arrival_seq

        return max(running, key=key)

    # ---------------------------------------------------------------- service
    def charge_prompt(self, req: Request, n: int) -> None:
        """The prompt tokens among the ``n`` planned from ``num_computed_tokens`` on."""
        start, prompt = req.num_computed_tokens, len(req.prompt_ids)
        if start < prompt:
            t = self.tenants[req.tenant]
            t.counter += (min(start + n, prompt) - start) * t.prompt_cost

    def charge_output(self, tokens_by_tenant: dict[str, int]) -> None:
        tenants = self.tenants
        for name, tokens in tokens_by_tenant.items():
            t = tenants.get(name)  # an ended tenant's idle entry may be evicted
            if t is not None:
                t.counter += tokens * t.output_cost

    # ------------------------------------------------------------ step shape
    def step_shape(
        self,
        step_id: int,
        running: list[Request],
        compute_bound: bool,
        allow_first_tokens: bool = True,
    ) -> StepShape:
        """A first-token step where one may come (never closer than the gap, someone waits
        and someone runs: ``next_waiting`` decides who is behind); else the whole budget,
        or, compute bound while a light tenant served lately is behind, a share of it."""
        if allow_first_tokens:  # else asked again for the same step, nothing changed since
            # Only admissions and a compute-bound device's shrinking ask; with one tenant
            # at work nobody is behind anybody, and the pass over the batch is skipped.
            asked = self._backlogged or compute_bound
            if asked and len(self._running.keys() | self._backlogged.keys()) > 1:
                self._prefilling = {
                    r.tenant for r in running if r.num_computed_tokens < len(r.prompt_ids)
                }
            else:
                self._prefilling = frozenset()
        tuning, last = self.tuning, self._last_first_token_step
        since = None if last is None else step_id - last
        if (
            allow_first_tokens
            and (since is None or since >= tuning.first_token_step_gap)
            and self._backlogged
            and self._running
            and len(running) < self.max_running
        ):
            return StepShape(
                self.max_num_batched_tokens,
                self.max_running,
                first_tokens=True,
                decodes_ride=not compute_bound,  # there every token costs: they wait a step
            )
        if (
            compute_bound
            and since is not None
            and since <= tuning.trickle_steps
            and self._contended()
        ):
            share = int(self.max_num_batched_tokens * tuning.compute_bound_budget_share)
            return StepShape(max(1, share), self.max_running)
        return self._full_step

    def first_token_step_planned(self, step_id: int) -> None:
        self._last_first_token_step = step_id

    def _next_behind(self, light: bool) -> Request | None:
        """The next request, in counter order, of a tenant behind in the batch: none of its
        prompts mid-prefill, it runs fewer than its weighted share of --max-num-seqs, and
        another tenant runs more (per weight). A light tenant, one asking for no more than
        its share, is behind also while a tenant asking for more has prompts to compute.
        ``light``: light tenants only."""
        if not self._backlogged or not self._running:
            return None
        # Not only the head: a tenant whose counter a burst's last chunk has not yet passed
        # still goes before that burst's next chunk (which is no admission: counters order
        # admissions). Being behind bounds what it can take to its share of the slots.
        behind = self._behind(light)
        tenants = [t for t in self._backlogged.values() if behind(t)]
        if not tenants:
            return None
        return min(tenants, key=self._order).queue.peek()

    def _contended(self) -> bool:
        """Whether a light tenant with work is behind in the batch."""
        if not self._running:
            return False
        behind = self._behind(light=True)
        return any(map(behind, self._running.values())) or any(
            map(behind, self._backlogged.values())
        )

    def _behind(self, light: bool) -> Callable[[Tenant], bool]:
        """See ``_next_behind``. A burst admits a request per prefill chunk, so until its
        prompts are computed it may run no more than a light tenant: counting slots alone,
        the light tenant's prompts would each wait behind a chunk of the burst's."""
        prefilling = self._prefilling
        waiting_only = sum(t.weight for t in self._backlogged.values() if not t.running)
        running_weight = sum(t.weight for t in self._running.values())
        per_weight = self.max_num_seqs / (running_weight + waiting_only)
        top = max(t.running / t.weight for t in self._running.values())

        def asks_over_share(t: Tenant | None) -> bool:
            return t is not None and t.running + len(t.queue) > t.weight * per_weight

        burst = any(map(asks_over_share, self._backlogged.values())) or any(
            map(asks_over_share, map(self.tenants.get, prefilling))
        )

        def behind(t: Tenant) -> bool:
            share = t.weight * per_weight
            if t.running >= share or t.name in prefilling:
                return False
            runs_less = t.running / t.weight < top
            if t.running + len(t.queue) <= share:  # a light tenant
                return runs_less or burst
            return runs_less and not light

        return behind
