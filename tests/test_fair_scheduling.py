"""Tenant fairness in the scheduler: virtual token counters decide admission and preemption.

A minimal device loop: every planned step is applied at once with a token that never
stops a request, so service is exactly what the scheduler hands out.
"""

from __future__ import annotations

import itertools
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_engine.core.config import EngineConfig
from async_engine.core.policy import FairPolicy, make_policy
from async_engine.core.policy.tenants import OUTPUT_PRICE, PROMPT_PRICE
from async_engine.core.request import Request, RequestStatus
from async_engine.core.scheduler import Scheduler, SchedulerConfig
from blockalloc import BlockPool
from sampler.params import SamplingParams
from streams.plan import StepPlan, StepResult

_ids = itertools.count()


def scheduler(
    policy="fair",
    *,
    seqs=4,
    budget=64,
    blocks=4096,
    weights=None,
    compute_bound=False,
    overflow=None,
    max_tenants=4096,
):
    """``overflow``: the fair policy's extra slots (None: its default)."""
    if policy == "fair":
        chosen = FairPolicy(seqs, budget, weights, overflow_seqs=overflow, max_tenants=max_tenants)
    else:
        chosen = make_policy(policy, seqs, budget, weights)
    sched = Scheduler(SchedulerConfig(4096, 4), BlockPool(blocks, 4), chosen)
    sched.compute_bound = compute_bound  # the engine sets it from measured step times
    return sched


def submit(
    sched: Scheduler,
    tenant: str,
    prompt: int = 8,
    out: int = 4,
    priority: int = 0,
    distinct: bool = False,
):
    """A request; ``distinct``: a prompt no other shares (no prefix-cache hits)."""
    tokens = [100 + next(_ids) % 30000 for _ in range(prompt)] if distinct else [5] * prompt
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    req = Request(
        f"r{next(_ids)}",
        tokens,
        params,
        max_model_len=4096,
        priority=priority,
        tenant=tenant,
        arrival_seq=next(_ids),
    )
    sched.add_request(req)
    return req


def sevens(plan: StepPlan) -> StepResult:
    """Token 7 for every sampled row of ``plan``."""
    return StepResult(plan.step_id, np.full(int(plan.sampled.sum()), 7, np.int64))


def step(sched: Scheduler) -> list[Request]:
    """Plan one step and apply it at once; the requests that got a token."""
    plan = sched.schedule()
    if plan is None:
        return []
    return sched.update_from_output(plan, sevens(plan))


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
    sched = scheduler(seqs=2)
    tenants = sched.policy.tenants
    for _ in range(20):
        submit(sched, "a")
        submit(sched, "b")
    for _ in range(30):
        step(sched)
    floor = min(tenants["a"].counter, tenants["b"].counter)
    assert floor > 0
    submit(sched, "idler")  # it received nothing while the others ran: no credit banked
    assert tenants["idler"].counter == floor


def test_weights_divide_service_in_their_ratio_while_both_are_backlogged():
    sched = scheduler(seqs=4, weights={"a": 3.0, "b": 1.0})
    served = {"a": 0.0, "b": 0.0}
    for _ in range(200):
        submit(sched, "a", prompt=4, out=8)
        submit(sched, "b", prompt=4, out=8)
    for _ in range(300):
        plan = sched.schedule()
        lens, samples = plan.query_lens.tolist(), plan.sampled.tolist()
        for req, n, sampled in zip(plan.requests, lens, samples, strict=True):
            prompt = max(0, min(n, len(req.prompt_ids) - req.num_computed_tokens + n))
            served[req.tenant] += PROMPT_PRICE * min(prompt, n) + OUTPUT_PRICE * sampled
        sched.update_from_output(plan, sevens(plan))
    assert served["a"] / served["b"] == pytest.approx(3.0, abs=0.3)


def test_preemption_takes_from_the_tenant_furthest_over_its_share():
    sched = scheduler(seqs=8, blocks=14)  # a small pool: growing outputs force preemption
    hog = [submit(sched, "hog", prompt=12, out=60) for _ in range(2)]
    for _ in range(6):
        step(sched)
    light = submit(sched, "light", prompt=4, out=60)
    for _ in range(40):
        step(sched)
        if sched.preemption.count:
            break
    assert sched.preemption.count
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
    tenants = sched.policy.tenants
    first = submit(sched, "b", prompt=30, out=50, distinct=True)
    step(sched)  # b's first-token step, charged its prompt
    assert first.status is RequestStatus.RUNNING
    # By counters a's next admission comes first (a still has requests waiting)...
    assert tenants["b"].counter > tenants["a"].counter
    assert any(r.status is RequestStatus.WAITING for r in sched.requests.values())
    late = submit(sched, "b", prompt=10, out=4, distinct=True)
    plan = sched.schedule()  # no first-token step: the last one was
    # ...yet b's late request is planned whole, before the burst's next prompt chunk.
    lens = plan.query_lens.tolist()
    order = [(r.request_id, r.tenant, n) for r, n in zip(plan.requests, lens, strict=True)]
    at = [rid for rid, _, _ in order].index(late.request_id)
    assert order[at][2] == 10
    chunks = [i for i, (_, tenant, n) in enumerate(order) if tenant == "a" and n > 1]
    assert chunks and min(chunks) > at


def test_a_late_tenant_keeps_decoding_while_the_burst_ahead_of_it_is_chunked():
    sched = long_prompts_in_prefill()
    late = submit(sched, "b", prompt=4, out=50, distinct=True)
    step(sched)  # b's first-token step puts it in the batch behind a's first prompt
    for _ in range(5):
        plan = sched.schedule()
        sched.update_from_output(plan, sevens(plan))
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


def test_first_token_steps_are_never_two_in_a_row_and_a_late_request_waits_one_step_at_most():
    sched = burst_in_prefill(compute_bound=True)
    kinds, late, served = [], [], {}
    for i in range(12):
        late.append((i, submit(sched, "b", prompt=4, out=1, distinct=True)))  # one every step
        plan = sched.schedule()
        kinds.append({r.tenant for r in plan.requests} == {"b"})
        sched.update_from_output(plan, sevens(plan))
        served |= {req: i for _, req in late if req.finished and req not in served}
    assert any(kinds)  # there are first-token steps, yet the burst keeps every other step
    assert not any(kinds[i] and kinds[i + 1] for i in range(len(kinds) - 1))
    # Each late request has its first token in the step it arrived before, or the next.
    assert all(served[req] - arrived <= 1 for arrived, req in late[:-1])


def test_tenants_sharing_the_batch_evenly_get_no_first_token_steps():
    sched = scheduler(seqs=8, budget=64)
    for _ in range(3):
        submit(sched, "a", prompt=40, out=50, distinct=True)
        submit(sched, "b", prompt=40, out=50, distinct=True)
    step(sched)
    for _ in range(4):  # b, running as many as a, sends one more before every step
        extra = submit(sched, "b", prompt=10, out=4, distinct=True)
        plan = sched.schedule()
        assert "a" in {r.tenant for r in plan.requests}  # no step of b's own
        assert planned(plan).get(extra.request_id, 0) < sum(planned(plan).values())
        sched.update_from_output(plan, sevens(plan))


def test_a_single_tenant_is_never_behind():
    # Compute bound: a first-token step would carry the new prompt alone, and a tenant
    # behind would shrink the steps. Neither may happen to a tenant behind nobody.
    sched = scheduler(seqs=8, budget=64, compute_bound=True)
    for _ in range(8):
        submit(sched, "a", prompt=40, out=50, distinct=True)
    step(sched)
    for _ in range(4):  # its own prefill goes on while it sends more
        submit(sched, "a", prompt=10, out=4, distinct=True)
        plan = sched.schedule()
        assert sum(planned(plan).values()) == 64  # the whole budget
        assert any(r.num_computed_tokens > 10 for r in plan.requests)  # its older prompts too
        sched.update_from_output(plan, sevens(plan))


def test_a_full_batch_takes_a_tenant_behind_into_the_overflow_slots_and_no_further():
    sched = scheduler(seqs=8, budget=512, overflow=2)
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
    assert len(sched.running) == 8 + 2  # b holds 3 of 10, still under its share of 4
    assert sum(r.request_id in running for r in more_b) == 1
    submit(sched, "a", prompt=8, out=100, distinct=True)
    step(sched)
    assert len(sched.running) == 10  # a, over its share, waits for a free slot


def test_a_compute_bound_device_shortens_its_steps_while_a_light_tenant_is_behind():
    # Every token costs such a device: a shorter step is a shorter wait for the trickle's
    # next request, which arrives while a step runs.
    sched = long_prompts_in_prefill(compute_bound=True)
    assert sum(planned(sched.schedule()).values()) == 64  # a alone: the whole budget
    b = submit(sched, "b", prompt=4, out=40, distinct=True)
    for _ in range(3):
        step(sched)  # b's first-token step, then b decodes beside a's prefill
    assert b.status is RequestStatus.RUNNING
    assert sum(planned(sched.schedule()).values()) < 64  # a's prompts had more to compute


def test_a_device_that_is_not_compute_bound_keeps_whole_steps_while_a_tenant_is_behind():
    sched = long_prompts_in_prefill()
    submit(sched, "b", prompt=4, out=40, distinct=True)
    for _ in range(3):
        step(sched)
    assert sum(planned(sched.schedule()).values()) == 64


def test_the_shorter_steps_end_once_the_light_tenant_stops_sending():
    sched = long_prompts_in_prefill(compute_bound=True)
    b = submit(sched, "b", prompt=4, out=100, distinct=True)
    step(sched)  # b's first-token step; b then decodes, still behind, and sends no more
    sizes = []
    for _ in range(20):
        plan = sched.schedule()
        sizes.append(sum(planned(plan).values()))
        sched.update_from_output(plan, sevens(plan))
    # b is still behind a burst with prompts to compute...
    assert b.status is RequestStatus.RUNNING
    assert any(r.tenant == "a" and r.num_computed_tokens < 400 for r in sched.requests.values())
    # ...but a light tenant that only drains is no trickle: whole steps again within 20.
    assert sizes[0] < 64 and sizes[-1] == 64


def test_idle_tenants_are_evicted_past_the_table_limit_and_busy_ones_kept():
    sched = scheduler(seqs=64, max_tenants=8)
    submit(sched, "busy", out=1000)
    step(sched)
    entry = sched.policy.tenants["busy"]
    for i in range(100):  # junk tenants, one short request each
        submit(sched, f"junk-{i}", out=1)
        while any(r.tenant.startswith("junk") for r in sched.requests.values()):
            step(sched)
    assert len(sched.policy.tenants) <= 8
    assert sched.policy.tenants["busy"] is entry  # with its counter: no credit lost or won


def service(sched: Scheduler, served: dict[str, float], weights: dict[str, float]) -> None:
    plan = sched.schedule()
    if plan is None:
        return
    lens, samples = plan.query_lens.tolist(), plan.sampled.tolist()
    for req, n, sampled in zip(plan.requests, lens, samples, strict=True):
        computed = req.num_computed_tokens
        prompt = max(0, min(computed, len(req.prompt_ids)) - (computed - n))
        served[req.tenant] += (PROMPT_PRICE * prompt + OUTPUT_PRICE * sampled) / weights[req.tenant]
    sched.update_from_output(plan, sevens(plan))


@settings(max_examples=40, deadline=None)
@given(
    burst=st.tuples(st.sampled_from("abc"), st.integers(20, 40)),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 40), st.sampled_from("abc"), st.integers(1, 40), st.integers(1, 24)
        ),
        min_size=10,
        max_size=80,
    ),
    weights=st.fixed_dictionaries({t: st.sampled_from([1.0, 2.0, 3.0]) for t in "abc"}),
)
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
        waiting = [r for r in sched.requests.values() if r.status is RequestStatus.WAITING]
        backlogged = {r.tenant for r in waiting}
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


def most_running(sched: Scheduler, steps: int = 80) -> int:
    """A burst fills the batch, then two light tenants send a request before every step
    for a while; the most requests that ran at once."""
    for _ in range(24):
        submit(sched, "burst", prompt=16, out=40, distinct=True)
    most = 0
    for i in range(steps):
        if i < 30:
            submit(sched, "b", prompt=4, out=30, distinct=True)
            submit(sched, "c", prompt=4, out=30, distinct=True)
        step(sched)
        most = max(most, len(sched.running))
    return most


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_max_num_seqs_is_never_exceeded_without_overflow(policy):
    sched = scheduler(policy, seqs=8, budget=64, overflow=0 if policy == "fair" else None)
    assert most_running(sched) == 8


def test_fair_runs_at_most_max_num_seqs_plus_the_default_overflow():
    overflow = EngineConfig(max_num_seqs=8, scheduling_policy="fair").resolved_fair_overflow_seqs()
    assert 0 < overflow < 8
    assert 8 < most_running(scheduler(seqs=8, budget=64)) <= 8 + overflow  # used, not passed
    assert EngineConfig(max_num_seqs=8, scheduling_policy="fcfs").resolved_fair_overflow_seqs() == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_fair_overflow_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="fair_overflow_seqs"):
        EngineConfig(fair_overflow_seqs=bad)
    assert EngineConfig(fair_overflow_seqs=0, max_num_seqs=8).resolved_fair_overflow_seqs() == 0


def trickle_ttfts(policy: str, burst: bool, cpu_rules: bool = True) -> list[float]:
    """Time to first token of a light tenant's requests on a modelled compute-bound device
    (a step takes 20 time units plus one per token it computes), beside a burst of long
    prompts or alone. Each request arrives at its own time, as a rule while a step runs,
    and is submitted before the next step is planned. ``cpu_rules``: the scheduler is told
    the device is compute bound, as the engine's step clock would."""
    sched = scheduler(policy, seqs=8, budget=64, compute_bound=cpu_rules)
    if burst:
        for _ in range(24):
            submit(sched, "a", prompt=120, out=40, distinct=True)
    arrivals = [37.0 + 111.0 * i for i in range(12)]
    light: list[tuple[float, Request]] = []
    now, ttfts = 0.0, {}
    while len(light) < len(arrivals) or sched.has_work():
        while len(light) < len(arrivals) and arrivals[len(light)] <= now:
            req = submit(sched, "b", prompt=12, out=4, distinct=True)
            light.append((arrivals[len(light)], req))
        plan = sched.schedule()
        if plan is None:  # idle until the next arrival
            now = max(now, arrivals[min(len(light), len(arrivals) - 1)])
            continue
        now += 20 + len(plan.input_ids)
        sched.update_from_output(plan, sevens(plan))
        ttfts |= {req: now - t for t, req in light if req.output_ids and req not in ttfts}
    return [ttfts[req] for _, req in light]


def test_a_trickles_first_tokens_beside_a_burst_come_within_twice_its_time_alone():
    alone = statistics.mean(trickle_ttfts("fair", burst=False))
    assert statistics.mean(trickle_ttfts("fair", burst=True)) <= 2 * alone
    # Controls: without the compute-bound rules (first-token steps with the decodes, whole
    # steps) the trickle waits longer on such a device; under fcfs, behind the whole burst.
    assert statistics.mean(trickle_ttfts("fair", burst=True, cpu_rules=False)) > 2 * alone
    assert statistics.mean(trickle_ttfts("fcfs", burst=True)) > 20 * alone
