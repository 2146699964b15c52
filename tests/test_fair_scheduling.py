"""Tenant fairness in the scheduler: virtual token counters decide admission and preemption.

A minimal device loop: every planned step is applied at once with a token that never
stops a request, so service is exactly what the scheduler hands out.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_engine.core.queues import OUTPUT_PRICE, PROMPT_PRICE, FairQueue, make_queue
from async_engine.core.request import Request, RequestStatus
from async_engine.core.scheduler import Scheduler, SchedulerConfig
from blockalloc import BlockPool
from sampler.params import SamplingParams

_ids = itertools.count()


def scheduler(policy="fair", *, seqs=4, budget=64, blocks=4096, weights=None, **queue_args):
    queue = FairQueue(weights, **queue_args) if policy == "fair" and queue_args else (
        make_queue(policy, weights))  # fmt: skip
    return Scheduler(SchedulerConfig(seqs, budget, 4096, 4), BlockPool(blocks, 4), queue)


def submit(sched: Scheduler, tenant: str, prompt: int = 8, out: int = 4, priority: int = 0):
    req = Request(f"r{next(_ids)}", [5] * prompt, SamplingParams(max_tokens=out, ignore_eos=True),
                  priority=priority, tenant=tenant, arrival_seq=next(_ids))  # fmt: skip
    sched.add_request(req)
    return req


def step(sched: Scheduler) -> list[Request]:
    """Plan one step and apply it at once; the requests that got a token."""
    plan = sched.schedule()
    if plan is None:
        return []
    return sched.update_from_output(plan, [7] * int(plan.sample.sum()))


def admitted_order(sched: Scheduler) -> list[str]:
    order = []
    while sched.has_work():
        before = {r.request_id for r in sched.running}
        step(sched)
        order += [r.tenant for r in sched.running if r.request_id not in before]
    return order


def test_fair_admits_the_tenant_with_less_service_before_a_bursts_backlog():
    sched = scheduler(seqs=1)
    for _ in range(6):
        submit(sched, "burst")
    step(sched)  # burst gets the only slot and some service
    submit(sched, "trickle")
    assert admitted_order(sched)[:2] == ["trickle", "burst"]


def test_fcfs_makes_the_late_tenant_wait_behind_the_whole_burst():
    sched = scheduler("fcfs", seqs=1)
    for _ in range(6):
        submit(sched, "burst")
    step(sched)
    submit(sched, "trickle")
    assert admitted_order(sched)[-1] == "trickle"


def test_priority_still_orders_requests_within_a_tenant():
    sched = scheduler(seqs=1)
    low = submit(sched, "a", priority=5)
    high = submit(sched, "a", priority=-5)
    step(sched)
    assert high.status is RequestStatus.RUNNING and low.status is RequestStatus.WAITING


def test_fcfs_ignores_priority_and_priority_policy_honours_it():
    for policy, first in (("fcfs", 5), ("priority", -5)):
        sched = scheduler(policy, seqs=1)
        submit(sched, "a", priority=5)
        submit(sched, "a", priority=-5)
        step(sched)
        assert sched.running[0].priority == first


def test_a_tenant_returning_from_idle_is_lifted_to_the_smallest_backlogged_counter():
    queue = FairQueue()
    sched = Scheduler(SchedulerConfig(2, 64, 4096, 4), BlockPool(4096, 4), queue)
    for _ in range(20):
        submit(sched, "a")
        submit(sched, "b")
    for _ in range(30):
        step(sched)
    floor = min(queue.tenants["a"].counter, queue.tenants["b"].counter)
    assert floor > 0
    submit(sched, "idler")  # it received nothing while the others ran: no credit banked
    assert queue.tenants["idler"].counter == floor


def test_weights_divide_service_in_their_ratio_while_both_are_backlogged():
    sched = scheduler(seqs=4, weights={"a": 3.0, "b": 1.0})
    served = {"a": 0.0, "b": 0.0}
    for _ in range(200):
        submit(sched, "a", prompt=4, out=8)
        submit(sched, "b", prompt=4, out=8)
    for _ in range(300):
        plan = sched.schedule()
        for req, n, sampled in zip(plan.requests, plan.query_lens.tolist(), plan.sample.tolist(),
                                   strict=True):  # fmt: skip
            prompt = max(0, min(n, len(req.prompt_ids) - req.num_computed_tokens + n))
            served[req.tenant] += PROMPT_PRICE * min(prompt, n) + OUTPUT_PRICE * sampled
        sched.update_from_output(plan, [7] * int(plan.sample.sum()))
    assert served["a"] / served["b"] == pytest.approx(3.0, abs=0.3)


def test_preemption_takes_from_the_tenant_furthest_over_its_share():
    sched = scheduler(seqs=8, blocks=14)  # a small pool: growing outputs force preemption
    hog = [submit(sched, "hog", prompt=12, out=60) for _ in range(2)]
    for _ in range(6):
        step(sched)
    light = submit(sched, "light", prompt=4, out=60)
    for _ in range(40):
        step(sched)
        if sched.num_preemptions:
            break
    assert sched.num_preemptions
    assert light.num_preemptions == 0 and sum(r.num_preemptions for r in hog) >= 1


def test_idle_tenants_are_evicted_past_the_table_limit_and_busy_ones_kept():
    sched = scheduler(seqs=64, max_tenants=8)
    busy = submit(sched, "busy", out=1000)
    step(sched)
    for i in range(100):  # junk tenants, one short request each
        submit(sched, f"junk-{i}", out=1)
        while any(r.tenant.startswith("junk") for r in sched.requests.values()):
            step(sched)
    queue = sched.waiting
    assert len(queue.tenants) <= 8
    assert queue.tenants["busy"] is busy.tenant_state


def service(sched: Scheduler, served: dict[str, float], weights: dict[str, float]) -> None:
    plan = sched.schedule()
    if plan is None:
        return
    for req, n, sampled in zip(plan.requests, plan.query_lens.tolist(), plan.sample.tolist(),
                               strict=True):  # fmt: skip
        prompt = max(0, min(req.num_computed_tokens, len(req.prompt_ids)) -
                     (req.num_computed_tokens - n))  # fmt: skip
        served[req.tenant] += (PROMPT_PRICE * prompt + OUTPUT_PRICE * sampled) / weights[req.tenant]
    sched.update_from_output(plan, [7] * int(plan.sample.sum()))


@settings(max_examples=40, deadline=None)
@given(
    burst=st.tuples(st.sampled_from("abc"), st.integers(20, 40)),
    arrivals=st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from("abc"), st.integers(1, 40),
                  st.integers(1, 24)),
        min_size=10, max_size=80,
    ),
    weights=st.fixed_dictionaries({t: st.sampled_from([1.0, 2.0, 3.0]) for t in "abc"}),
)  # fmt: skip
def test_backlogged_tenants_service_stays_within_the_vtc_bound(burst, arrivals, weights):
    check_vtc_bound("fair", burst, arrivals, weights)


def test_fcfs_breaks_the_bound_that_fair_keeps():
    arrivals = [(1, "b", 8, 8), (2, "b", 8, 8), (3, "b", 8, 8)]
    with pytest.raises(AssertionError, match="service difference"):
        check_vtc_bound("fcfs", ("a", 40), arrivals, dict.fromkeys("abc", 1.0))
    check_vtc_bound("fair", ("a", 40), arrivals, dict.fromkeys("abc", 1.0))


def check_vtc_bound(policy, burst, arrivals, weights) -> None:
    """One tenant sends a burst at step 0, then random arrivals; while two or more tenants
    are backlogged, the service each gained since differs by at most VTC's bound: twice
    the largest request's weighted service, times the requests that run at once."""
    seqs = 4
    sched = scheduler(policy, seqs=seqs, budget=32, weights=weights)
    served = dict.fromkeys("abc", 0.0)
    trace = [(0, burst[0], 24, 16)] * burst[1] + list(arrivals)
    largest = max((PROMPT_PRICE * p + OUTPUT_PRICE * o) / weights[t] for _, t, p, o in trace)
    bound = 2 * largest * seqs
    by_step: dict[int, list] = {}
    for at, tenant, prompt, out in trace:
        by_step.setdefault(at, []).append((tenant, prompt, out))
    start: dict[str, float] | None = None
    for t in range(2000):
        for tenant, prompt, out in by_step.get(t, ()):
            submit(sched, tenant, prompt=prompt, out=out)
        service(sched, served, weights)
        backlogged = {r.tenant for r in sched.requests.values()
                      if r.status is RequestStatus.WAITING}  # fmt: skip
        if len(backlogged) >= 2:
            start = start or dict(served)
            gains = [served[x] - start[x] for x in backlogged]
            assert max(gains) - min(gains) <= bound + 1e-6, (
                f"service difference {max(gains) - min(gains):.0f} over the bound {bound:.0f}"
            )
        else:
            start = None
        if not sched.has_work() and t > 40:
            break
