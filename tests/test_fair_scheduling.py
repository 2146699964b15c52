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
from async_engine.core.scheduler import TRICKLE_STEPS, Scheduler, SchedulerConfig
from blockalloc import BlockPool
from sampler.params import SamplingParams

_ids = itertools.count()


def scheduler(policy="fair", *, seqs=4, budget=64, blocks=4096, weights=None,
              compute_bound=False, **queue_args):  # fmt: skip
    queue = FairQueue(weights, **queue_args) if policy == "fair" and queue_args else (
        make_queue(policy, weights))  # fmt: skip
    config = SchedulerConfig(seqs, budget, 4096, 4, compute_bound=compute_bound)
    return Scheduler(config, BlockPool(blocks, 4), queue)


def submit(sched: Scheduler, tenant: str, prompt: int = 8, out: int = 4, priority: int = 0,
           distinct: bool = False):  # fmt: skip
    """A request; ``distinct``: a prompt no other shares (no prefix-cache hits)."""
    tokens = [100 + next(_ids) % 30000 for _ in range(prompt)] if distinct else [5] * prompt
    req = Request(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=out, ignore_eos=True),
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


def test_one_steps_admissions_follow_the_counters_as_each_is_charged():
    sched = scheduler(seqs=8, budget=32)
    for tenant in "aaaabbbb":
        submit(sched, tenant, prompt=8, distinct=True)
    plan = sched.schedule()
    assert [r.tenant for r in plan.requests] == ["a", "b", "a", "b"]


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


def burst_in_prefill(seqs: int = 8, **kwargs) -> Scheduler:
    """Tenant a's 8 long prompts fill the batch (of 8) and are mid-prefill; some decode."""
    sched = scheduler(seqs=seqs, budget=64, **kwargs)
    for _ in range(8):
        submit(sched, "a", prompt=40, out=50, distinct=True)
    for _ in range(3):
        step(sched)
    return sched


def long_prompts_in_prefill(**kwargs) -> Scheduler:
    """Tenant a asks for 6 of 8 slots (its share is 4) with prompts that each take several
    steps; after one step its first prompt is mid-prefill and the rest wait."""
    sched = scheduler(seqs=8, budget=64, **kwargs)
    for _ in range(6):
        submit(sched, "a", prompt=400, out=50, distinct=True)
    step(sched)
    return sched


def planned(plan) -> dict[str, int]:
    """Tokens per request id in a plan."""
    return {r.request_id: n for r, n in zip(plan.requests, plan.query_lens.tolist(), strict=True)}


def test_a_tenant_behind_in_the_batch_gets_a_step_before_the_bursts_prefill_goes_on():
    sched = burst_in_prefill()
    late = submit(sched, "b", prompt=10, out=4, distinct=True)
    plan = sched.schedule()
    tokens = planned(plan)
    assert tokens.pop(late.request_id) == 10  # its whole prompt: the first token is this step's
    assert tokens and all(n == 1 for n in tokens.values())  # a's decodes ride, no prefill chunk


def test_on_a_compute_bound_device_that_step_carries_the_late_tenant_alone():
    sched = burst_in_prefill(compute_bound=True)
    late = submit(sched, "b", prompt=10, out=4, distinct=True)
    assert planned(sched.schedule()) == {late.request_id: 10}


def test_a_tenant_running_as_many_as_a_burst_in_prefill_still_goes_before_its_next_chunk():
    sched = long_prompts_in_prefill()
    submit(sched, "b", prompt=4, out=50, distinct=True)
    step(sched)  # b's first-token step
    step(sched)  # a's chunk, b's decode
    assert sorted(r.tenant for r in sched.running) == ["a", "b"]  # one each: even by slots
    late = submit(sched, "b", prompt=10, out=4, distinct=True)
    tokens = planned(sched.schedule())
    assert tokens.pop(late.request_id) == 10
    assert all(n == 1 for n in tokens.values())  # no chunk of a's prompt in its step


def test_a_tenant_behind_goes_before_the_bursts_chunk_even_in_a_step_that_cannot_be_its_own():
    sched = scheduler(seqs=16, budget=64)
    for _ in range(16):
        submit(sched, "a", prompt=200, out=50, distinct=True)
    step(sched)
    submit(sched, "b", prompt=4, out=50, distinct=True)
    step(sched)  # b's first-token step: the next one may not be another
    late = submit(sched, "b", prompt=10, out=4, distinct=True)
    tokens = planned(sched.schedule())
    assert tokens[late.request_id] == 10
    assert any(n > 1 for rid, n in tokens.items() if rid != late.request_id)  # a's chunk too


def test_a_tenant_behind_is_admitted_before_the_burst_has_caught_up_with_its_counter():
    sched = burst_in_prefill(seqs=16)
    queue = sched.waiting
    first = submit(sched, "b", prompt=30, out=50, distinct=True)
    step(sched)  # b's first-token step, charged its prompt
    assert queue.tenants["b"].counter > queue.tenants["a"].counter
    late = submit(sched, "b", prompt=10, out=4, distinct=True)
    assert queue.peek().tenant == "a"  # a's next admission comes first by counters...
    behind = queue.next_behind(16, sched.prefilling_tenants(), light=True)
    assert behind is late  # ...not a's next chunk
    assert first.status is RequestStatus.RUNNING


def test_a_late_tenant_keeps_decoding_while_the_burst_ahead_of_it_is_chunked():
    sched = long_prompts_in_prefill()
    late = submit(sched, "b", prompt=4, out=50, distinct=True)
    step(sched)  # b's first-token step puts it in the batch behind a's first prompt
    for _ in range(5):
        plan = sched.schedule()
        sched.update_from_output(plan, [7] * int(plan.sample.sum()))
        tokens = planned(plan)
        assert tokens[late.request_id] == 1  # decodes take the budget before chunks
        assert sum(tokens.values()) == 64


def test_a_light_tenants_first_token_step_takes_all_its_waiting_and_none_of_the_burst():
    sched = scheduler(seqs=8, budget=64)
    for _ in range(6):  # more than a's share of 4 slots
        submit(sched, "a", prompt=64, out=50, distinct=True)
    step(sched)  # a's first prompt, whole: a runs one request and has none mid-prefill
    late = [submit(sched, "b", prompt=4, out=50, distinct=True) for _ in range(2)]
    tokens = planned(sched.schedule())
    assert tokens == {r.request_id: 4 for r in late} | {
        r.request_id: 1 for r in sched.running if r.tenant == "a"
    }  # a, now running fewer than b, is no light tenant: its next prompt waits


def test_first_token_steps_are_never_two_in_a_row():
    sched = burst_in_prefill(compute_bound=True)
    kinds = []
    for _ in range(12):
        submit(sched, "b", prompt=4, out=1, distinct=True)  # a new late request before every step
        plan = sched.schedule()
        kinds.append({r.tenant for r in plan.requests} == {"b"})
        sched.update_from_output(plan, [7] * int(plan.sample.sum()))
    assert not any(kinds[i] and kinds[i + 1] for i in range(len(kinds) - 1))
    assert sum(kinds) == 6  # every other step


def test_tenants_sharing_the_batch_evenly_get_no_first_token_steps():
    sched = scheduler(seqs=8, budget=64)
    for _ in range(3):
        submit(sched, "a", prompt=40, out=50, distinct=True)
        submit(sched, "b", prompt=40, out=50, distinct=True)
    step(sched)
    extra = submit(sched, "b", prompt=10, out=4, distinct=True)
    behind = sched.waiting.next_behind(8, sched.prefilling_tenants(), light=False)
    assert behind is None  # b runs as many as a
    tokens = planned(sched.schedule())
    assert tokens.get(extra.request_id, 0) < sum(tokens.values())


def test_a_single_tenant_is_never_behind():
    sched = scheduler(seqs=8, budget=64)
    for _ in range(4):
        submit(sched, "a", prompt=40, out=50, distinct=True)
    step(sched)
    submit(sched, "a", prompt=10, out=4, distinct=True)
    prefilling = sched.prefilling_tenants()
    assert prefilling == {"a"}  # its own prefill does not put it behind
    assert sched.waiting.next_behind(8, prefilling, light=False) is None
    assert not sched.waiting.contended(8, prefilling)


def test_a_full_batch_takes_a_tenant_under_its_share_up_to_a_quarter_more():
    sched = scheduler(seqs=8, budget=512)
    for _ in range(8):
        submit(sched, "a", prompt=8, out=100, distinct=True)
    step(sched)
    first_b = submit(sched, "b", prompt=4, out=100, distinct=True)
    step(sched)  # b's first request takes a ninth slot
    more_b = [submit(sched, "b", prompt=4, out=100, distinct=True) for _ in range(3)]
    for _ in range(4):
        step(sched)
    running = {r.request_id for r in sched.running}
    assert first_b.request_id in running
    assert len(sched.running) == 8 + 8 // 4  # b holds 3 of 10, still under its share of 4
    assert sum(r.request_id in running for r in more_b) == 1
    submit(sched, "a", prompt=8, out=100, distinct=True)
    step(sched)
    assert len(sched.running) == 10  # a, over its share, waits for a free slot


def test_a_compute_bound_device_halves_its_steps_while_a_tenant_is_behind():
    sched = burst_in_prefill(compute_bound=True)
    assert sum(planned(sched.schedule()).values()) == 64  # a alone: the whole budget
    submit(sched, "b", prompt=4, out=40, distinct=True)
    for _ in range(3):
        step(sched)  # b's first-token step, then b decodes beside a's prefill
    assert sched.waiting.contended(8, sched.prefilling_tenants())
    assert sum(planned(sched.schedule()).values()) <= 32


def test_the_halving_ends_once_the_light_tenant_stops_sending():
    sched = long_prompts_in_prefill(compute_bound=True)
    submit(sched, "b", prompt=4, out=100, distinct=True)
    step(sched)  # b's first-token step; b then decodes, still behind, and sends no more
    sizes = []
    for _ in range(TRICKLE_STEPS + 4):
        plan = sched.schedule()
        sizes.append(sum(planned(plan).values()))
        sched.update_from_output(plan, [7] * int(plan.sample.sum()))
    assert sched.waiting.contended(8, sched.prefilling_tenants())
    assert sizes[0] <= 32 and sizes[-1] == 64


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
