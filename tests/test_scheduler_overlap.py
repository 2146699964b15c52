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
from async_engine.core.step_times import StepTimes
from blockalloc import BlockPool
from sampler.params import SamplingParams
from streams.plan import StepPlan, StepResult
from streams.rows import RowState
from streams.verify import emitted_counts, keep_emitted

BLOCK = 4


def truth(rid: str, index: int) -> int:
    return (sum(map(ord, rid)) * 7 + index * 31) % 997 + 3


@dataclass
class FakeDevice:
    """Keeps the device-side row state the real devices keep, and checks every input."""

    rows: RowState = field(default_factory=lambda: RowState(BLOCK, 64, rows=2))
    prompts: dict[int, tuple[str, list[int]]] = field(default_factory=dict)  # row -> request
    kv: dict[int, tuple[str, int]] = field(default_factory=dict)  # KV slot -> (rid, pos)
    drafter: object = None

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


class TruthDrafter:
    """Drafts a request's true next tokens, one in three of its proposals wrong somewhere."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.calls = 0

    def propose(self, rows, tokens, ks):
        out = []
        for row, seq, k in zip(rows, tokens, ks, strict=True):
            rid, prompt = self.device.prompts[row]
            start = len(seq) - len(prompt)
            drafts = [truth(rid, start + j) for j in range(k)]
            self.calls += 1
            if self.calls % 3 == 0:
                drafts[self.calls % k] += 1
            out.append(np.array(drafts, np.int64))
        return out

    def release(self, row, tokens):
        pass


class VerifyingDevice(FakeDevice):
    """The fake device with rows that verify drafts: the truth is the model's token at
    every position, so a row emits its drafts while they are true, then the true one."""

    def run(self, plan: StepPlan, tables_at_launch: dict[int, list[int]]) -> StepResult:
        for row in plan.released_rows.tolist():
            self.prompts.pop(row, None)
        for new in plan.new_rows:
            self.prompts[new.row] = (new.params.extra_rid, new.prompt_ids)
        self.rows.apply(plan)
        for row, table in tables_at_launch.items():
            assert self.rows.table(row) == table, f"row {row}: device table differs"
        layout = self.rows.layout(plan, self.drafter)  # raises if a table is too short
        ids = self.rows.placeholder_tokens(layout)
        for t, (pos, token) in enumerate(zip(layout.positions, ids, strict=True)):
            rid, prompt = self.prompts[int(layout.token_rows[t])]
            want = prompt[pos] if pos < len(prompt) else truth(rid, pos - len(prompt))
            if layout.input_ids[t] >= 0 and t not in set(layout.sample_index.tolist()[1:]):
                assert token == want, f"{rid}: position {pos} got {token}, want {want}"
        targets = []
        for s, index in enumerate(layout.sample_index.tolist()):
            rid, prompt = self.prompts[int(layout.sample_rows[s])]
            targets.append(truth(rid, int(layout.positions[index]) + 1 - len(prompt)))
        targets = np.array(targets, np.int64)
        nsampled = layout.num_sampled[layout.num_sampled > 0]
        counts = emitted_counts(targets, layout.next_drafts, layout.sample_offsets, nsampled)
        tokens = targets[keep_emitted(layout.sample_offsets, nsampled, counts)]
        self.rows.record(layout, tokens, counts)
        result = StepResult(plan.step_id, tokens)
        if layout.verifying:
            result.counts, result.drafted = counts, layout.drafted
        return result


@settings(max_examples=120, deadline=None)
@given(
    reqs=requests_strategy,
    num_blocks=st.integers(12, 40),
    budget=st.integers(6, 48),
    overlap=st.booleans(),
    aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 7)), max_size=3),
    k=st.integers(1, 5),
    policy=st.sampled_from(["priority", "fair"]),
    prefix_cache=st.booleans(),
)
def test_rows_that_verify_drafts_stay_exact_under_overlap_preemption_and_aborts(
    reqs, num_blocks, budget, overlap, aborts, k, policy, prefix_cache
):
    from async_engine.core.speculation import Speculation
    from streams.drafting.config import SpeculativeConfig

    pool = BlockPool(num_blocks, BLOCK, prefix_cache)
    sched = Scheduler(SchedulerConfig(64, BLOCK), pool, make_policy(policy, 4, budget))
    config = SpeculativeConfig("ngram", num_speculative_tokens=k, adaptive=False)
    sched.speculation = Speculation(config, sched.table, StepTimes())
    device = VerifyingDevice()
    device.drafter = TruthDrafter(device)
    requests = []
    for i, (prompt_len, max_tokens) in enumerate(reqs):
        rid = f"r{i}"
        prompt = [1 + (j if j < 8 else i * 50 + j) for j in range(prompt_len)]
        if len(prompt) + max_tokens > num_blocks * BLOCK:
            continue
        req = Request(rid, prompt, make_params(rid, max_tokens), max_model_len=64, arrival_seq=i)
        sched.add_request(req)
        requests.append(req)
    abort_at: dict[int, list[int]] = {}
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
            done, tables = inflight.pop(0)
            sched.update_from_output(done, device.run(done, tables))
        pool.check_invariants()
        step += 1
        assert step < 2000, "the scheduler stopped making progress"
    for req in requests:
        assert req.finished
        assert req.output_ids == [truth(req.request_id, i) for i in range(len(req.output_ids))]
        if req.finish_reason is FinishReason.LENGTH:
            assert len(req.output_ids) == req.params.max_tokens
    assert pool.num_free == pool.num_blocks and not sched.requests
