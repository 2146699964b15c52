"""The contract between the scheduler and a scheduling policy."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from async_engine.core.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step may be, as the policy decides it."""

    budget: int  # tokens the step may carry
    # Requests that may run once the step's admissions are in: --max-num-seqs, plus any
    # overflow the policy grants (the scheduler admits nobody at or past it).
    max_running: int
    # A first-token step: only the requests ``next_waiting(first_tokens=True)`` names are
    # admitted, and no running request's prompt chunk rides along.
    first_tokens: bool = False
    decodes_ride: bool = True  # a first-token step carries the running decodes too


class Policy:
    """Decides order, victims, service accounting and the shape of each step.

    The scheduler owns the running list, the KV blocks and the plans; the policy owns the
    waiting requests (in queues of its own, ``async_engine.core.queues``) and whatever
    state it keeps per request or per group of requests, none of it on the request.
    The scheduler calls, and the policy answers:

    - ``add(req)``: ``req`` waits (new, preempted or started over on a new device).
    - ``remove(req)``: a waiting ``req`` leaves without running (it ended while waiting).
    - ``step_shape(step_id, running, compute_bound)``: once per step before planning it.
      ``compute_bound``: every token of a step costs the device about the same (measured
      from step times), unlike a device that reads the weights once for a whole batch. If
      the answer is a first-token step and nobody could be admitted into it, the scheduler
      asks again at once (nothing changed) with ``allow_first_tokens=False`` for an
      ordinary step's shape. A step that plans nothing is asked for again, same id.
    - ``next_waiting(num_running, first_tokens)``: the waiting request to admit next, or
      None to admit no more this step. ``first_tokens``: only one that belongs in a
      first-token step (asked for one, and in ordinary steps before the running prompts'
      chunks). The scheduler has already checked ``num_running < max_running``.
    - ``admitted(req, n)``: ``req``, what ``next_waiting`` just returned, runs with ``n``
      tokens planned from ``req.num_computed_tokens``: it leaves the waiting queue.
    - ``first_token_step_planned(step_id)``: the first-token step asked for was planned.
    - ``left_running(req)``: a running ``req`` stopped running (ended, preempted, or its
      device was lost).
    - ``victim(running, planned)``: whom to preempt among ``running`` for blocks;
      ``planned`` already has tokens this step.
    - ``charge_prompt(req, n)`` and ``charge_output(tokens_by_tenant)``: service, called
      only where ``charges_service`` is True. ``charge_prompt``: ``n`` tokens of a running
      request planned from ``req.num_computed_tokens``, before the plan moves it
      (admissions are charged by ``admitted``). ``charge_output``: the output tokens each
      tenant's requests got from one step (only accepted tokens: drafts that were not
      verified cost their tenant nothing), once per step in bulk.

    No hook may cost a policy that keeps no per-request state anything per request per
    step: the scheduler skips the charges where ``charges_service`` is False, and the
    other hooks run once per step or once per request's admission or end.
    """

    charges_service = False

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    @property
    def num_waiting(self) -> int:
        raise NotImplementedError

    def add(self, req: Request) -> None:
        raise NotImplementedError

    def remove(self, req: Request) -> None:
        raise NotImplementedError

    def step_shape(
        self,
        step_id: int,
        running: list[Request],
        compute_bound: bool,
        allow_first_tokens: bool = True,
    ) -> StepShape:
        raise NotImplementedError

    def next_waiting(self, num_running: int, first_tokens: bool) -> Request | None:
        raise NotImplementedError

    def admitted(self, req: Request, n: int) -> None:
        raise NotImplementedError

    def first_token_step_planned(self, step_id: int) -> None:
        pass

    def left_running(self, req: Request) -> None:
        pass

    def victim(self, running: list[Request], planned: list[Request]) -> Request:
        raise NotImplementedError

    def charge_prompt(self, req: Request, n: int) -> None:
        pass

    def charge_output(self, tokens_by_tenant: dict[str, int]) -> None:
        pass

    def tenant_depths(
        self, requests: Iterable[Request], limit: int = 64
    ) -> list[tuple[str, int, int]]:
        """(tenant, waiting, running) of tenants with work, most waiting first."""
        depths: dict[str, list[int]] = {}
        for req in requests:
            if req.status is RequestStatus.WAITING:
                depths.setdefault(req.tenant, [0, 0])[0] += 1
            elif req.status is RequestStatus.RUNNING:
                depths.setdefault(req.tenant, [0, 0])[1] += 1
        ranked = sorted(depths.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))
        return [(name, w, r) for name, (w, r) in ranked[:limit]]
