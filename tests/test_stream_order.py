"""Stream order, checked on CPU: the host twin that stamps every tensor access with its stream
(``streams.pipeline.stream_order``) finds writes and reads that nothing orders, and the model
runner, run under it, has none; the start-up, staging and failed-step races it had before
their fixes are found again when the fix is taken out."""

from __future__ import annotations

import pytest
import torch
from pipelined_runs import (
    NUM_BLOCKS,
    PARAMS,
    LookaheadDrafter,
    assert_same_results,
    first_step_plan,
    make_tiny_model,
    pipelined_runner,
    reference_runner,
    walk_device_drafts,
    walk_two_deep,
)
from plan_walk import PlanWalk

from async_engine.model import cpu_kernels
from sampler.params import SamplingParams
from streams.pipeline import devsync, slots
from streams.pipeline.runner import PipelinedRunner
from streams.pipeline.stream_order import OrderedSync, StreamRace
from streams.plan import NewRow, StepPlan, int32s, int64s

DEVICE = torch.device("cpu")  # an explicit device: the device's tensors, not the host's


@pytest.fixture
def sync() -> OrderedSync:
    return OrderedSync()


# ------------------------------------------------------------------ the check itself
def _made(sync: OrderedSync, *tensors: torch.Tensor) -> None:
    """Tensors made on the default stream, ordered before what the test issues next."""
    sync.synchronize()


def test_a_read_on_another_stream_with_nothing_ordering_it_after_the_write_is_a_race(sync):
    writer, reader = sync.stream(), sync.stream()
    with pytest.raises(StreamRace, match="sum on stream 2 reads a tensor written on stream 1"):
        with sync.watch():
            x = torch.zeros(8, device=DEVICE)
            _made(sync, x)
            with sync.use(writer):
                x.fill_(1)
            with sync.use(reader):
                x.sum()


def test_an_event_recorded_after_the_write_and_waited_on_orders_the_read(sync):
    writer, reader = sync.stream(), sync.stream()
    done = sync.event()
    with sync.watch():
        x = torch.zeros(8, device=DEVICE)
        _made(sync, x)
        with sync.use(writer):
            x.fill_(1)
            done.record()
        reader.wait_event(done)
        with sync.use(reader):
            assert float(x.sum()) == 8


def test_an_event_recorded_before_the_write_does_not_order_it(sync):
    writer, reader = sync.stream(), sync.stream()
    early = sync.event()
    with pytest.raises(StreamRace, match="reads a tensor written on stream 1"):
        with sync.watch():
            x = torch.zeros(8, device=DEVICE)
            _made(sync, x)
            with sync.use(writer):
                early.record()
                x.fill_(1)
            reader.wait_event(early)
            with sync.use(reader):
                x.sum()


def test_waiting_on_the_stream_or_on_the_host_orders_later_work(sync):
    writer, reader = sync.stream(), sync.stream()
    with sync.watch():
        x, y = torch.zeros(8, device=DEVICE), torch.zeros(8, device=DEVICE)
        _made(sync, x, y)
        with sync.use(writer):
            x.fill_(1)
        reader.wait_stream(writer)
        with sync.use(writer):
            y.fill_(1)
        sync.synchronize()
        with sync.use(reader):
            x.sum()
            y.sum()


def test_a_write_after_an_unordered_read_on_another_stream_is_a_race(sync):
    reader, writer = sync.stream(), sync.stream()
    with pytest.raises(StreamRace, match="fill_ on stream 2 writes a tensor read on stream 1"):
        with sync.watch():
            x = torch.zeros(8, device=DEVICE)
            _made(sync, x)
            with sync.use(reader):
                x.sum()
            with sync.use(writer):
                x.fill_(2)


def test_an_empty_allocation_is_not_a_write(sync):
    copier = sync.stream()
    with sync.watch():
        source = torch.arange(8, device=DEVICE)
        _made(sync, source)
        staged = torch.empty(8, dtype=torch.int64, device=DEVICE)
        with sync.use(copier):
            staged.copy_(source)


def test_a_zero_fill_is_a_write_that_another_streams_copy_must_follow(sync):
    """The staging regrowth race: zeros issued on the default stream, then another stream's
    copy into the same tensor."""
    copier = sync.stream()
    with pytest.raises(StreamRace, match="copy_ on stream 1 writes a tensor written on default"):
        with sync.watch():
            source = torch.arange(8, device=DEVICE)
            _made(sync, source)
            zeroed = torch.zeros(8, dtype=torch.int64, device=DEVICE)
            with sync.use(copier):
                zeroed.copy_(source)


def test_a_tensor_freed_while_another_streams_work_on_it_may_be_queued_is_a_race(sync):
    user = sync.stream()
    with pytest.raises(StreamRace, match="default's pool freed while stream 1's work"):
        with sync.watch():
            x = torch.ones(8, device=DEVICE)  # from the default stream's pool
            _made(sync, x)
            with sync.use(user):
                x.sum()
            del x
            torch.zeros(1, device=DEVICE)


def test_a_tensor_freed_once_the_host_knows_the_work_is_done_is_no_race(sync):
    user = sync.stream()
    done = sync.event()
    with sync.watch():
        x = torch.ones(8, device=DEVICE)
        _made(sync, x)
        with sync.use(user):
            x.sum()
            done.record()
        done.synchronize()
        del x
        torch.zeros(1, device=DEVICE)


def _copy_to_host(sync: OrderedSync) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(host copy, its device source: alive until the copy is known done, its event)."""
    copier, copied = sync.stream(), sync.event()
    source = torch.arange(8, device=DEVICE)
    pinned = sync.pinned(8, torch.int64)  # the host's
    _made(sync, source, pinned)
    with sync.use(copier):
        pinned.copy_(source)
        copied.record()
    return pinned, source, copied


def test_the_host_reading_a_copy_to_the_host_before_waiting_for_it_is_a_race(sync):
    with pytest.raises(StreamRace, match="sum on the host reads a tensor, before waiting"):
        with sync.watch():
            pinned, _source, _ = _copy_to_host(sync)
            pinned.sum()


def test_the_host_reads_a_copy_to_the_host_once_it_waited_for_it(sync):
    with sync.watch():
        pinned, _source, copied = _copy_to_host(sync)
        copied.synchronize()
        assert int(pinned.sum()) == 28


def test_host_tensors_are_the_hosts_wherever_the_op_is_issued(sync):
    """A host mirror touched inside a stream's block runs on the host when issued."""
    compute = sync.stream()
    with sync.watch():
        mirror = torch.zeros(8)
        with sync.use(compute):
            mirror[2] = 1
        mirror[3] = 1
        assert int(mirror.sum()) == 2


# ------------------------------------------------------------------ the runner under it
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-stream-order"))


@pytest.fixture
def ordered(monkeypatch, sync) -> OrderedSync:
    """Runners made in the test run on the checking twin, on torch's attention path (the
    CPU kernels read the cache through pointers the check cannot see)."""
    monkeypatch.setattr(devsync, "for_device", lambda device: sync)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    return sync


def _walk(tiny: str, runner: PipelinedRunner, steps: int, drafts: int = 0) -> None:
    reference = reference_runner(tiny)
    drafter = LookaheadDrafter(reference) if drafts else None
    if drafter is not None:
        runner.drafter = drafter
    walk = PlanWalk(3, 160, 4, NUM_BLOCKS, PARAMS, drafts)
    walk_two_deep(walk, reference, runner, steps, drafter)


def test_two_steps_in_flight_order_every_access(tiny, ordered):
    """Prompt chunks, decodes, preemptions, rows released and reused, row state regrown."""
    with ordered.watch():
        _walk(tiny, pipelined_runner(tiny, cuda_graphs=False), 40)


def test_rows_verifying_drafts_in_the_padded_buckets_order_every_access(tiny, ordered):
    buckets = {"cuda_graphs": True, "eager_buckets": True, "graph_tokens_per_row": 5}
    with ordered.watch():
        _walk(tiny, pipelined_runner(tiny, graph_max_batch=8, **buckets), 30, drafts=4)


def test_rows_drafting_and_verifying_on_the_device_order_every_access(tiny, ordered):
    """The n-gram drafter reading the device's copy of the rows' tokens, verification and the
    counts it writes there, and the host taking them a step later."""
    with ordered.watch():
        expected, got, _ = walk_device_drafts(tiny, 1, steps=40, ngram=True, cuda_graphs=False)
    assert sum(int(r.drafted.sum()) for r in got if r.drafted is not None) > 10
    assert_same_results(expected, got)


def test_without_the_start_up_wait_the_first_step_races_the_cache_zeroing(
    tiny, ordered, monkeypatch
):
    monkeypatch.setattr(OrderedSync, "synchronize", lambda self: None)
    with pytest.raises(StreamRace, match="written on default"), ordered.watch():
        runner = pipelined_runner(tiny, cuda_graphs=False)
        runner.finish(runner.launch(first_step_plan()))


def _long_prompts_plan() -> StepPlan:
    """Two prompts whose step outgrows the slots' first staging (1,024 ints)."""
    greedy = SamplingParams(temperature=0, max_tokens=None)
    length, blocks = 180, 45
    prompts = {row: [(7 * i + row) % 150 + 1 for i in range(length)] for row in (0, 1)}
    return StepPlan(
        0,
        int32s([0, 1]),
        int32s([0, 0]),
        int32s([length, length]),
        int32s([1, 1]),
        int64s(prompts[0] + prompts[1]),
        [NewRow(row, greedy, prompt, []) for row, prompt in prompts.items()],
        new_blocks=int32s([x for r in (0, 1) for b in range(blocks) for x in (r, r * blocks + b)]),
    )


def test_regrown_staging_is_not_zero_filled_where_the_copy_writes_it(tiny, ordered):
    with ordered.watch():
        runner = pipelined_runner(tiny, cuda_graphs=False)
        result = runner.finish(runner.launch(_long_prompts_plan()))
        assert result.error is None


def test_zero_filled_staging_races_the_copy_into_it(tiny, ordered, monkeypatch):
    """The fix taken out: a regrown slot's device staging made with zeros."""
    made = slots.new_slot

    def zeroed(sync, device, ints, sampled):
        slot = made(sync, device, ints, sampled)
        slot.dev_in = torch.zeros(ints, dtype=torch.int64, device=device)
        return slot

    monkeypatch.setattr(slots, "new_slot", zeroed)
    with pytest.raises(StreamRace, match="writes a tensor written on default"), ordered.watch():
        runner = pipelined_runner(tiny, cuda_graphs=False)
        runner.finish(runner.launch(_long_prompts_plan()))


def _regrow_rows_under_a_queued_step(runner: PipelinedRunner) -> None:
    """Row 70 joins while step 0 is in flight: the device rows (64 at first) grow."""
    greedy = SamplingParams(temperature=0, max_tokens=None)
    queued = runner.launch(first_step_plan())
    regrowing = StepPlan(
        1,
        int32s([70]),
        int32s([0]),
        int32s([2]),
        int32s([1]),
        int64s([4, 5]),
        [NewRow(70, greedy, [4, 5], [])],
        new_blocks=int32s([70, 9]),
    )
    results = [runner.finish(queued), runner.finish(runner.launch(regrowing))]
    assert [r.error for r in results] == [None, None]


def test_row_state_regrown_under_a_queued_step_is_freed_in_order(tiny, ordered):
    with ordered.watch():
        _regrow_rows_under_a_queued_step(pipelined_runner(tiny, cuda_graphs=False))


def test_row_state_made_on_the_default_stream_is_freed_under_queued_steps(
    tiny, ordered, monkeypatch
):
    """The fix taken out: the device rows allocated outside the compute stream, then
    regrown (and the old ones freed) while a step that reads them is queued."""

    def on_default(self):
        self.recorder.reset()
        return self._new_rows()

    monkeypatch.setattr(PipelinedRunner, "_fresh_rows", on_default)
    with pytest.raises(StreamRace, match="default's pool freed while stream 1's work"):
        with ordered.watch():
            runner = pipelined_runner(tiny, cuda_graphs=False)
            _regrow_rows_under_a_queued_step(runner)


def _fail_second_step(runner: PipelinedRunner) -> None:
    forward, calls = runner.forward, []

    def failing(*args):
        calls.append(1)
        logits = forward(*args)
        if len(calls) == 2:
            raise RuntimeError("the forward failed")
        return logits

    runner.forward = failing


def _three_steps_two_in_flight(runner: PipelinedRunner) -> list:
    greedy = SamplingParams(temperature=0, max_tokens=None)
    plans = [
        StepPlan(
            step,
            int32s([step]),
            int32s([0]),
            int32s([3]),
            int32s([1]),
            int64s([1, 2, 3]),
            [NewRow(step, greedy, [1, 2, 3], [])],
            new_blocks=int32s([step, step]),
        )
        for step in range(3)
    ]
    first = runner.launch(plans[0])
    failed = runner.launch(plans[1])  # fails after its compute work read its slot
    results = [runner.finish(first), runner.finish(failed)]
    return [*results, runner.finish(runner.launch(plans[2]))]


def test_a_failed_step_gives_its_slot_back_only_after_the_device_is_done(tiny, ordered):
    with ordered.watch():
        runner = pipelined_runner(tiny, cuda_graphs=False)
        _fail_second_step(runner)
        results = _three_steps_two_in_flight(runner)
    assert [r.error is None for r in results] == [True, False, True]


def test_a_failed_step_that_gives_its_slot_back_at_once_races_the_next_copy(
    tiny, ordered, monkeypatch
):
    """The fix taken out: the slot freed without waiting for the step's queued work."""
    with pytest.raises(StreamRace), ordered.watch():
        runner = pipelined_runner(tiny, cuda_graphs=False)
        monkeypatch.setattr(OrderedSync, "synchronize", lambda self: None)
        _fail_second_step(runner)
        _three_steps_two_in_flight(runner)
