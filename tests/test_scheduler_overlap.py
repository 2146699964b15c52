"""Scheduler bookkeeping under overlap, preemption and aborts, with a fake device.

The fake device produces token i of a request as a pure function of (request, i) and
checks every input it receives: a stale or duplicated placeholder, a token fed at the
wrong position, or a block reused while a launched step still writes it shows up here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from async_engine.core.policy import make_policy
from async_engine.core.request import FinishReason, Request
from async_engine.core.scheduler import Scheduler, SchedulerConfig
from blockalloc import BlockPool
from sampler.params import SamplingParams
from streams.plan import StepPlan, StepResult
from streams.rows import RowState

BLOCK = 4


def truth(rid: str, index: int) -> int:
    return (sum(map(ord, rid)) * 7 + index * 31) % 997 + 3


@dataclass
class FakeDevice:
    """Keeps the device-side row state the real devices keep, and checks every input."""

    rows: RowState = field(default_factory=lambda: RowState(BLOCK, 64, rows=2))
    prompts: dict[int, tuple[str, list[int]]] = field(default_factory=dict)  # row -> request
    kv: dict[int, tuple[str, int]] = field(default_factory=dict)  # KV slot -> (rid, pos)

    def run(self, plan: StepPlan, tables_at_launch: dict[int, list[int]]) -> StepResult:
        for row in plan.released_rows.tolist():
            self.prompts.pop(row, None)
        for new in plan.new_rows:
            self.prompts[new.row] = (new.params.extra_rid, new.prompt_ids)
        self.rows.apply(plan)
        # The incremental protocol: the device's tables equal what a full plan would carry.
        for row, table in tables_at_launch.items():
            assert self.rows.table(row) == table, f"row {row}: device table differs"
        layout = self.rows.layout(plan)
        ids = self.rows.placeholder_tokens(layout)
        out, t = [], 0
        for i, row in enumerate(plan.rows.tolist()):
            rid, prompt = self.prompts[row]
            for j in range(plan.query_lens[i]):
                pos, token = int(layout.positions[t + j]), int(ids[t + j])
                expected = prompt[pos] if pos < len(prompt) else truth(rid, pos - len(prompt))
                assert token == expected, f"{rid}: position {pos} got {token}, want {expected}"
                self.kv[int(layout.kv_slots[t + j])] = (rid, pos)
            # Every position of the context must be readable from this request's blocks.
            for pos in range(int(layout.context_lens[i])):
                kv_slot = int(self.rows.tables[row, pos // BLOCK]) * BLOCK + pos % BLOCK
                owner = self.kv.get(kv_slot)
                assert owner is not None and owner[1] == pos, f"{rid}: KV at {pos} is {owner}"
            t += plan.query_lens[i]
            if plan.num_sampled[i]:
                out.append(truth(rid, int(layout.context_lens[i]) - len(prompt)))
        tokens = np.array(out, dtype=np.int64)
        self.rows.record(layout, tokens, np.ones(len(tokens), np.int32))
        return StepResult(plan.step_id, tokens)


class Params(SamplingParams):
    """SamplingParams that also tell the fake device which request a slot holds."""

    __slots__ = ("extra_rid",)


def make_params(rid: str, max_tokens: int) -> SamplingParams:
    params = Params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    object.__setattr__(params, "extra_rid", rid)
    return params


requests_strategy = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=8
)


@settings(max_examples=150, deadline=None)
@given(
    reqs=requests_strategy,
    num_blocks=st.integers(12, 40),
    budget=st.integers(4, 48),
    overlap=st.booleans(),
    aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 7)), max_size=3),
)
def test_outputs_are_exact_and_every_block_returns(reqs, num_blocks, budget, overlap, aborts):
    pool = BlockPool(num_blocks, BLOCK)
    sched = Scheduler(SchedulerConfig(64, BLOCK), pool, make_policy("priority", 4, budget))
    device = FakeDevice()
    requests = []
    for i, (prompt_len, max_tokens) in enumerate(reqs):
        rid = f"r{i}"
        # Shared heads let the prefix cache take part.
        prompt = [1 + (j if j < 8 else i * 50 + j) for j in range(prompt_len)]
        if len(prompt) + max_tokens > num_blocks * BLOCK:
            continue
        req = Request(rid, prompt, make_params(rid, max_tokens), max_model_len=64, arrival_seq=i)
        sched.add_request(req)
        requests.append(req)
    abort_at = {}
    for step, idx in aborts:
        abort_at.setdefault(step, []).append(idx)

    inflight: list[tuple[StepPlan, dict[int, list[int]]]] = []
    step = 0
    while sched.has_work() or inflight:
        for idx in abort_at.get(step, []):
            if idx < len(requests):
                sched.finish(requests[idx], FinishReason.ABORTED)
        plan = sched.schedule()
        if plan is not None:
            inflight.append((plan, {r.row: list(r.block_ids) for r in plan.requests}))
        if inflight and (not overlap or len(inflight) == 2 or plan is None):
            # The device runs steps in launch order; step N runs after N+1 was planned.
            done, tables = inflight.pop(0)
            sched.update_from_output(done, device.run(done, tables))
        pool.check_invariants()
        step += 1
        assert step < 2000, "the scheduler stopped making progress"

    for req in requests:
        assert req.finished
        want = [truth(req.request_id, i) for i in range(len(req.output_ids))]
        assert req.output_ids == want
        if req.finish_reason is FinishReason.LENGTH:
            assert len(req.output_ids) == req.params.max_tokens
    assert pool.num_free == pool.num_blocks
    assert not sched.requests
