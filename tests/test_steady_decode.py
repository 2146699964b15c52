"""Steady decode runs (core/steady.py) are an optimization only: with them the scheduler
plans, applies, ends and frees exactly what it does without them."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from async_engine.core.policy import make_policy
from async_engine.core.request import FinishReason, Request
from async_engine.core.scheduler import Scheduler, SchedulerConfig
from blockalloc import BlockPool, block_hashes
from sampler.params import SamplingParams

VOCAB = 500
STOP = 7  # a token some requests stop at


def token_for(req: Request, position: int) -> int:
    """The model's token for ``req`` at ``position``: a pure function, like the sim's."""
    if position % 23 == 0:
        return STOP
    return zlib.crc32(f"{req.request_id}:{position}".encode()) % (VOCAB - 10) + 10


def make_scheduler(policy: str, blocks: int, steady: bool, prefix_cache: bool) -> Scheduler:
    pool = BlockPool(blocks, 4, prefix_cache)
    sched = Scheduler(SchedulerConfig(256, 4), pool, make_policy(policy, 16, 64, {}, 1.0, None))
    if not steady:
        sched.steady.try_start = lambda *args, **kwargs: None
    return sched


def run(seed: int, policy: str, steady: bool, blocks: int = 400, prefix_cache: bool = True):
    """Random arrivals, aborts and stops with two steps in flight; returns what happened."""
    rng = random.Random(seed)
    sched = make_scheduler(policy, blocks, steady, prefix_cache)
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
                    plan.sample.tolist(),
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
                    done.requests, done.starts, done.query_lens, done.sample, strict=True
                )
                if sampled
            ]
            sched.update_from_output(done, np.array(tokens, np.int64))
        if not arrivals and not sched.has_work() and not inflight:
            break
    sched.sync_requests()
    ends = [(r.output_ids, r.finish_reason, r.stop_reason) for r in reqs]
    # The fair policy's service counters: the run charges per batch, not per request.
    service = sorted((name, t.counter) for name, t in getattr(sched.policy, "tenants", {}).items())
    return log, ends, sched.wasted_tokens, sched.pool.num_used, service


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
@pytest.mark.parametrize("seed", range(12))
def test_a_steady_run_plans_and_applies_exactly_what_the_full_scheduler_does(policy, seed):
    with_runs = run(seed, policy, steady=True)
    without = run(seed, policy, steady=False)
    assert with_runs == without
    assert with_runs[3] == 0, "every block went back to the pool"


@pytest.mark.parametrize("seed", range(6))
def test_a_steady_run_gives_way_to_preemption_when_the_pool_is_short(seed):
    assert run(seed, "fcfs", True, blocks=40) == run(seed, "fcfs", False, blocks=40)


def test_steady_runs_happen_in_these_workloads():
    sched = make_scheduler("fcfs", 400, steady=True, prefix_cache=True)
    starts = []
    original = sched.steady.try_start

    def spy(*args, **kwargs):
        original(*args, **kwargs)
        starts.append(sched.steady.active)

    sched.steady.try_start = spy
    for i in range(4):
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        sched.add_request(Request(f"r{i}", [11, 12, 13, i + 20], params, max_model_len=256))
    inflight = []
    steady_plans = 0
    while sched.has_work() or inflight:
        plan = sched.schedule()
        if plan is not None:
            inflight.append(plan)
            steady_plans += sched.steady.owns(plan)
        if len(inflight) == 2 or (plan is None and inflight):
            done = inflight.pop(0)
            sched.update_from_output(done, np.full(int(done.sample.sum()), 50, np.int64))
    assert any(starts) and steady_plans >= 20
    assert all(len(r.output_ids) == 30 for r in sched.running) and sched.pool.num_used == 0


def test_a_run_goes_on_beside_prompts_and_admissions():
    sched = make_scheduler("fair", 2000, steady=True, prefix_cache=True)
    beside = 0
    inflight = []
    for step in range(200):
        if step < 40 and step % 2 == 0:
            params = SamplingParams(max_tokens=60, ignore_eos=True)
            prompt = [11, 12, 13, 14, 15, 16, 17, step + 20]
            sched.add_request(Request(f"r{step}", prompt, params, max_model_len=256))
        plan = sched.schedule()
        if plan is not None:
            inflight.append(plan)
            if sched.steady.owns(plan) and (plan.new_rows or plan.query_lens.max() > 1):
                beside += 1
        if len(inflight) == 2 or (plan is None and inflight):
            done = inflight.pop(0)
            sched.update_from_output(done, np.full(int(done.sample.sum()), 50, np.int64))
    assert beside >= 5, "runs carried prompts and admissions beside their rows"
    assert sched.pool.num_used == 0 and not sched.has_work()


def test_each_full_block_of_a_request_is_hashed_once(monkeypatch):
    import async_engine.core.kv_manager as kv_manager

    hashed = []

    def counting(token_ids, block_size, parent=None):
        hashed.append(len(token_ids) // block_size)
        return block_hashes(token_ids, block_size, parent)

    monkeypatch.setattr(kv_manager, "block_hashes", counting)
    sched = make_scheduler("fcfs", 400, steady=False, prefix_cache=True)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    sched.add_request(Request("r", list(range(20, 33)), params, max_model_len=256))  # 13 tokens
    while sched.has_work():
        plan = sched.schedule()
        sched.update_from_output(plan, np.full(int(plan.sample.sum()), 50, np.int64))
    assert sum(hashed) == (13 + 8) // 4  # its lookup's 3 prompt blocks served registration
