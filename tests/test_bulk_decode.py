"""Decodes chosen and applied over the row table's arrays (``RowChooser.bulk_decodes``,
``step_results._apply_bulk``) are an optimization only: the scheduler plans, applies, ends
and frees exactly what it does choosing and applying them one request at a time."""

from __future__ import annotations

import contextlib
import random
import zlib
from unittest import mock

import numpy as np
import pytest

from async_engine.core import scheduler as scheduler_module
from async_engine.core import step_results
from async_engine.core.policy import make_policy
from async_engine.core.request import FinishReason, Request
from async_engine.core.scheduler import Scheduler, SchedulerConfig
from blockalloc import BlockPool, block_hashes
from sampler.params import SamplingParams
from streams.plan import StepResult

VOCAB = 500
STOP = 7  # a token some requests stop at


def token_for(req: Request, position: int) -> int:
    """The model's token for ``req`` at ``position``: a pure function, like the sim's."""
    if position % 23 == 0:
        return STOP
    return zlib.crc32(f"{req.request_id}:{position}".encode()) % (VOCAB - 10) + 10


def make_scheduler(
    policy: str, blocks: int, bulk: bool, prefix_cache: bool, budget: int = 64
) -> Scheduler:
    pool = BlockPool(blocks, 4, prefix_cache)
    policies = make_policy(policy, 16, budget, {}, 1.0, None)
    return Scheduler(SchedulerConfig(256, 4), pool, policies)


def planned_one_by_one(bulk: bool):
    """Unless ``bulk``, the arrays' planner declines every step, so the scheduler chooses its
    decodes one by one (as in a step short of blocks)."""
    if bulk:
        return contextlib.nullcontext()
    return mock.patch.object(scheduler_module, "plan_decodes", lambda *args, **kwargs: None)


def one_by_one(monkeypatch) -> None:
    """Every step's tokens applied request by request."""

    def apply_each(rows, tokens, touched, lists, table, max_model_len, finish, now):
        ones = np.ones(len(rows), np.int64)
        zeros = np.zeros(len(rows), np.int64)
        result = StepResult(0, tokens)
        return step_results._apply_each(
            rows, ones, zeros, tokens, result, table, max_model_len, finish, now
        )

    monkeypatch.setattr(step_results, "_apply_bulk", apply_each)


def run(
    seed: int,
    policy: str,
    bulk: bool,
    blocks: int = 400,
    prefix_cache: bool = True,
    budget: int = 64,
):
    """Random arrivals, aborts and stops with two steps in flight; returns what happened."""
    with planned_one_by_one(bulk):
        return _run(seed, policy, bulk, blocks, prefix_cache, budget)


def _run(seed: int, policy: str, bulk: bool, blocks: int, prefix_cache: bool, budget: int):
    rng = random.Random(seed)
    sched = make_scheduler(policy, blocks, bulk, prefix_cache, budget)
    arrivals = sorted(rng.randrange(60) for _ in range(24))
    aborts = {rng.randrange(120): rng.randrange(24) for _ in range(3)}
    reqs: list[Request] = []
    plans, inflight, log = [], [], []
    shared = [rng.randrange(10, VOCAB) for _ in range(12)]  # a common prompt prefix
    for step in range(400):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            i = len(reqs)
            prompt = shared[: rng.randrange(13)] + [rng.randrange(10, VOCAB) for _ in range(5)]
            params = SamplingParams(
                max_tokens=rng.randrange(1, 40),
                stop_token_ids=[STOP] if i % 3 == 0 else [],
                ignore_eos=True,
            )
            reqs.append(Request(f"r{i}", prompt, params, max_model_len=256, tenant=f"t{i % 3}"))
            sched.add_request(reqs[-1])
        if step in aborts and aborts[step] < len(reqs) and not reqs[aborts[step]].finished:
            sched.finish(reqs[aborts[step]], FinishReason.ABORTED)
        plan = sched.schedule()
        if plan is not None:
            plans.append(plan)
            inflight.append(plan)
            log.append(
                (
                    plan.step_id,
                    plan.rows.tolist(),
                    plan.starts.tolist(),
                    plan.query_lens.tolist(),
                    plan.num_sampled.tolist(),
                    plan.input_ids.tolist(),
                    plan.new_blocks.tolist(),
                    sorted(plan.released_rows.tolist()),
                )
            )
        if len(inflight) == 2 or (plan is None and inflight):
            done = inflight.pop(0)
            tokens = [
                token_for(req, int(start) + int(n))
                for req, start, n, sampled in zip(
                    done.requests, done.starts, done.query_lens, done.num_sampled, strict=True
                )
                if sampled
            ]
            sched.update_from_output(done, StepResult(done.step_id, np.array(tokens, np.int64)))
        if not arrivals and not sched.has_work() and not inflight:
            break
    ends = [(r.output_ids, r.finish_reason, r.stop_reason) for r in reqs]
    # The fair policy's service counters: the run charges per batch, not per request.
    service = sorted((name, t.counter) for name, t in getattr(sched.policy, "tenants", {}).items())
    return log, ends, sched.wasted_tokens, sched.pool.num_used, service


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
@pytest.mark.parametrize("seed", range(12))
def test_decodes_over_arrays_plan_exactly_what_one_by_one_planning_does(policy, seed):
    in_bulk = run(seed, policy, bulk=True)
    assert in_bulk == run(seed, policy, bulk=False)
    assert in_bulk[3] == 0, "every block went back to the pool"


def step_two_deep(sched: Scheduler, inflight: list, log: list) -> None:
    """Plan a step (logged) and apply the one before it, token 50 for every sampled row."""
    plan = sched.schedule()
    if plan is not None:
        inflight.append(plan)
        log.append((plan.rows.tolist(), plan.starts.tolist(), plan.input_ids.tolist()))
    if len(inflight) == 2 or (plan is None and inflight):
        done = inflight.pop(0)
        tokens = np.full(int(done.sampled.sum()), 50, np.int64)
        sched.update_from_output(done, StepResult(done.step_id, tokens))


def shrinking_budget(bulk: bool) -> list:
    """16 requests decode; then every step's budget is 5 (as a compute-bound device's share
    can be), fewer tokens than the batch has decodes, and a prompt arrives now and then."""
    from async_engine.core.policy import StepShape

    with planned_one_by_one(bulk):
        sched = make_scheduler("fcfs", 400, bulk, True, budget=64)
        for i in range(16):
            params = SamplingParams(max_tokens=12 + i, ignore_eos=True)
            sched.add_request(Request(f"r{i}", [11, 12, i + 20], params, max_model_len=256))
        log, inflight = [], []
        for step in range(80):
            if step == 3:
                sched.policy._shape = StepShape(5, 16)
            if step % 9 == 4:
                params = SamplingParams(max_tokens=4, ignore_eos=True)
                prompt = [30 + step] * 7
                sched.add_request(Request(f"late{step}", prompt, params, max_model_len=256))
            step_two_deep(sched, inflight, log)
        return log


def test_a_budget_smaller_than_the_batch_cuts_bulk_decodes_where_one_by_one_does():
    in_bulk = shrinking_budget(bulk=True)
    assert max(len(rows) for rows, _, _ in in_bulk[5:]) == 5  # the budget cut the batch
    assert in_bulk == shrinking_budget(bulk=False)


@pytest.mark.parametrize("seed", range(12))
def test_tokens_applied_over_arrays_end_and_free_exactly_as_one_by_one(seed, monkeypatch):
    in_bulk = run(seed, "fair", bulk=True)
    one_by_one(monkeypatch)
    assert run(seed, "fair", bulk=True) == in_bulk


@pytest.mark.parametrize("seed", range(6))
def test_bulk_decodes_give_way_to_preemption_when_the_pool_is_short(seed):
    assert run(seed, "fcfs", True, blocks=40) == run(seed, "fcfs", False, blocks=40)


def test_bulk_decodes_carry_steady_batches_and_prompts_beside_them(monkeypatch):
    sched = make_scheduler("fair", 2000, bulk=True, prefix_cache=True)
    bulk_steps = beside = 0
    original = scheduler_module.plan_decodes

    def spy(*args, **kwargs):
        nonlocal bulk_steps
        out = original(*args, **kwargs)
        bulk_steps += out is not None and out[0] is not None
        return out

    monkeypatch.setattr(scheduler_module, "plan_decodes", spy)
    inflight = []
    for step in range(200):
        if step < 40 and step % 2 == 0:
            params = SamplingParams(max_tokens=60, ignore_eos=True)
            prompt = [11, 12, 13, 14, 15, 16, 17, step + 20]
            sched.add_request(Request(f"r{step}", prompt, params, max_model_len=256))
        plan = sched.schedule()
        if plan is not None:
            inflight.append(plan)
            beside += bool(plan.new_rows) and (plan.query_lens == 1).sum() > 1
        if len(inflight) == 2 or (plan is None and inflight):
            done = inflight.pop(0)
            tokens = np.full(int(done.sampled.sum()), 50, np.int64)
            sched.update_from_output(done, StepResult(done.step_id, tokens))
    assert bulk_steps >= 100 and beside >= 5
    assert sched.pool.num_used == 0 and not sched.has_work()


def test_a_scrape_between_steps_changes_nothing_that_is_planned():
    from async_engine.server.metrics import kv_fragmentation

    class Engine:
        scheduler: Scheduler

    with_scrapes, plain = [], []
    for log, scrape in ((with_scrapes, True), (plain, False)):
        sched = make_scheduler("fcfs", 400, bulk=True, prefix_cache=True)
        engine = Engine()
        engine.scheduler = sched
        for i in range(6):
            params = SamplingParams(max_tokens=20, ignore_eos=True)
            sched.add_request(Request(f"r{i}", [11, 12, 13, i + 20], params, max_model_len=256))
        inflight = []
        while sched.has_work() or inflight:
            if scrape:
                kv_fragmentation(engine, 4)
            step_two_deep(sched, inflight, log)
    assert with_scrapes == plain


def test_each_full_block_of_a_request_is_hashed_once(monkeypatch):
    import async_engine.core.kv_manager as kv_manager

    hashed = []

    def counting(token_ids, block_size, parent=None):
        hashed.append(len(token_ids) // block_size)
        return block_hashes(token_ids, block_size, parent)

    monkeypatch.setattr(kv_manager, "block_hashes", counting)
    sched = make_scheduler("fcfs", 400, bulk=True, prefix_cache=True)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    sched.add_request(Request("r", list(range(20, 33)), params, max_model_len=256))  # 13 tokens
    while sched.has_work():
        plan = sched.schedule()
        tokens = np.full(int(plan.sampled.sum()), 50, np.int64)
        sched.update_from_output(plan, StepResult(plan.step_id, tokens))
    assert sum(hashed) == (13 + 8) // 4  # its lookup's 3 prompt blocks served registration
