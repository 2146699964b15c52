"""The pipelined runner's parts and failures: decode buckets padded to fixed sizes, the host
stream/event shim, the event clock, the device process loop, KV memory sizing, and a step or
a device that fails. Its tokens against the synchronous runner's are in
tests/test_pipelined_runner.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pipelined_runs import BLOCK, first_step_plan, make_tiny_model, pipelined_runner, seeded_model

from sampler.params import SamplingParams
from streams.device import DeviceError
from streams.pipeline import devsync
from streams.pipeline.clock import EventClock
from streams.pipeline.graphs import DecodeGraphs, bucket_sizes
from streams.pipeline.memory import RESERVE_BYTES, blocks_that_fit
from streams.pipeline.runner import SLOTS, _raise_if_device_lost
from streams.plan import NewRow, StepPlan, int32s, int64s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-pipeline"))


# ------------------------------------------------------------------ decode buckets
def test_bucket_sizes_cover_the_largest_batch_with_few_graphs():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 4]
    assert bucket_sizes(80) == [1, 2, 4, *range(8, 88, 8)]
    assert bucket_sizes(81)[-1] == 88
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_every_bucket_with_padding_equals_the_unpadded_forward(tiny):
    from streams.batch import ForwardBatch

    model = seeded_model(tiny)
    bs, blocks = BLOCK, 200
    kv = model.allocate_kv_cache(blocks + 1, bs)
    gen = torch.Generator().manual_seed(0)
    for k, v in kv:
        k.normal_(generator=gen)
        v.normal_(generator=gen)
    graphs = DecodeGraphs(model, kv, 20, 8, blocks, bs, torch.device("cpu"))
    for live in range(1, 21):
        ctx = torch.randint(1, 8 * bs, (live,), generator=gen)
        tables = torch.randperm(blocks, generator=gen)[: live * 8].view(live, 8)
        pos = ctx - 1
        slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        ids = torch.randint(0, 160, (live,), generator=gen)
        before = [k.clone() for k, _ in kv]
        batch = ForwardBatch(ids, pos, slots, [1] * live, ctx.tolist(), tables, torch.arange(live))
        want = model(batch, kv)
        written = [k.clone() for k, _ in kv]
        for (k, _), old in zip(kv, before, strict=True):
            k.copy_(old)  # the padded run writes the same slots again
        got = graphs.run(ids, pos, slots, ctx, ctx.tolist(), tables, torch.arange(live))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for (k, _), ref in zip(kv, written, strict=True):
            # Padding wrote only the dummy block; every real block is as the unpadded run left it.
            torch.testing.assert_close(k[:blocks], ref[:blocks], atol=0, rtol=0)


def test_verify_buckets_pad_rows_of_several_tokens_to_the_unpadded_forward(tiny):
    """Rows of 1 to 5 tokens (a last token and up to 4 drafts), some near their block table's
    end: each real token's logits and KV as unpadded; padding writes only the dummy block."""
    from streams.batch import ForwardBatch

    model = seeded_model(tiny)
    bs, blocks, width = BLOCK, 200, 8
    kv = model.allocate_kv_cache(blocks + 1, bs)
    gen = torch.Generator().manual_seed(1)
    for k, v in kv:
        k.normal_(generator=gen)
        v.normal_(generator=gen)
    graphs = DecodeGraphs(model, kv, 20, width, blocks, bs, torch.device("cpu"), None, 5)
    assert graphs.bucket(3, 5) == (4, 5) and graphs.bucket(3, 2) == (4, 5)
    assert graphs.bucket(3, 6) is None and graphs.bucket(3, 1) == (4, 1)
    for live in (1, 3, 8, 20):
        qlens = torch.randint(1, 6, (live,), generator=gen)
        ctx = torch.randint(1, width * bs - 5, (live,), generator=gen) + qlens
        ctx[0] = width * bs  # a row whose context ends its block table
        tables = torch.randperm(blocks, generator=gen)[: live * width].view(live, width)
        rows_of = torch.repeat_interleave(torch.arange(live), qlens)
        starts = torch.cumsum(qlens, 0) - qlens
        pos = ctx[rows_of] - qlens[rows_of] + torch.arange(len(rows_of)) - starts[rows_of]
        slots = tables[rows_of, pos // bs] * bs + pos % bs
        ids = torch.randint(0, 160, (len(rows_of),), generator=gen)
        before = [k.clone() for k, _ in kv]
        every = torch.arange(len(rows_of))
        batch = ForwardBatch(ids, pos, slots, qlens.tolist(), ctx.tolist(), tables, every)
        want = model(batch, kv)
        written = [k.clone() for k, _ in kv]
        for (k, _), old in zip(kv, before, strict=True):
            k.copy_(old)
        got = graphs.run(
            ids, pos, slots, ctx, ctx.tolist(), tables, torch.arange(live),
            qlens.numpy(), qlens, starts,
        )  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for (k, _), ref, old in zip(kv, written, before, strict=True):
            # The real tokens' KV as unpadded (to rounding: other matmul shapes); every other
            # slot of a real block untouched: padding wrote only the dummy block.
            torch.testing.assert_close(k[:blocks], ref[:blocks], atol=1e-5, rtol=1e-5)
            untouched = (ref == old)[:blocks]
            assert torch.equal(k[:blocks][untouched], old[:blocks][untouched])


def test_verify_buckets_stop_where_their_logits_would_outgrow_the_limit(tiny):
    model = seeded_model(tiny)
    kv = model.allocate_kv_cache(9, BLOCK)
    graphs = DecodeGraphs(model, kv, 80, 4, 8, BLOCK, torch.device("cpu"), None, 5, 100)
    assert graphs.bucket(16, 5) == (16, 5) and graphs.bucket(24, 5) is None
    assert graphs.bucket(80, 1) == (80, 1)


# ------------------------------------------------------------------ shim and clock
def test_waiting_on_an_unrecorded_event_is_an_error():
    sync = devsync.for_device("cpu")
    stream, event = sync.stream(), sync.event()
    with pytest.raises(RuntimeError, match="never recorded"):
        stream.wait_event(event)
    event.record(stream)
    stream.wait_event(event)
    assert event.query()


class FakeEvent:
    def __init__(self, at_ms: float) -> None:
        self.at_ms = at_ms

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at_ms - self.at_ms


class FakeSync(devsync.DeviceSync):
    def __init__(self, anchors: list[float]) -> None:
        super().__init__(torch.device("cpu"))
        self.anchors = anchors

    def event(self, timing: bool = False, blocking: bool = False) -> FakeEvent:
        return FakeEvent(self.anchors.pop(0))


def test_events_map_onto_the_host_clock_through_the_anchor():
    host = iter([99.9, 100.1, 100.5, 103.0])
    clock = EventClock(FakeSync([5000.0]), now=lambda: next(host))
    clock.anchor()  # device 5000 ms == host 100 s: the midpoint of the stamps around it
    assert clock.to_host(FakeEvent(5250.0)) == pytest.approx(100.25)
    assert clock.to_host(FakeEvent(4990.0)) == pytest.approx(99.99)
    assert not clock.anchor_due()  # host 100.5: half a second after the anchor
    assert clock.anchor_due()  # host 103.0


class Float32Event(FakeEvent):
    """A CUDA event's elapsed_time: float32 milliseconds."""

    def elapsed_time(self, end: FakeEvent) -> float:
        return float(np.float32(end.at_ms - self.at_ms))


def test_gaps_stay_precise_through_an_hour_without_an_idle_anchor():
    """Float32 milliseconds from one anchor place events an hour on to ~0.1 ms: as coarse as
    the gaps measured. With step ends as anchors, a gap reads two events a fraction of a
    second after the same anchor."""
    host = iter([10.0, 10.0])
    clock = EventClock(FakeSync([0.0]), now=lambda: next(host))
    clock.anchor()
    clock._anchor = (Float32Event(0.0), 10.0)  # the anchor's elapsed_time is float32 too
    worst_gap = worst_single = 0.0
    step_ms, busy_ms = 100.0333, 99.0071  # steps back to back: a 1.0262 ms gap each
    last_end = clock.to_host(Float32Event(0.0), advance=True)
    for i in range(1, 36_000):  # an hour, never idle
        at = i * step_ms
        start = clock.to_host(Float32Event(at - busy_ms))
        gap = start - last_end
        worst_gap = max(worst_gap, abs(gap - (step_ms - busy_ms) / 1e3))
        single = float(np.float32(at - busy_ms)) - float(np.float32(at - step_ms))
        worst_single = max(worst_single, abs(single - (step_ms - busy_ms)) / 1e3)
        last_end = clock.to_host(Float32Event(at), advance=True)
    assert worst_gap < 0.5e-6 and worst_single > 50 * worst_gap
    assert abs(last_end - (10.0 + at / 1e3)) < 1e-4  # placement drifts little meanwhile


def test_gaps_between_steps_come_from_the_events_alone():
    host = iter([50.0, 50.0])
    clock = EventClock(FakeSync([0.0]), now=lambda: next(host))
    clock.anchor()
    end_n, start_next = FakeEvent(10.0), FakeEvent(10.25)
    gap = clock.to_host(start_next) - clock.to_host(end_n)
    assert gap == pytest.approx(0.25e-3)


# ------------------------------------------------------------------ the device loop
def test_device_process_launches_the_next_step_before_reporting_one(monkeypatch):
    import os
    import select
    from pathlib import Path

    from streams.device import DeviceSpec
    from streams.process_device import ProcessDevice

    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    import pipelined_fakes

    device = ProcessDevice(DeviceSpec(pipelined_fakes.build_late_runner, threads=0))
    try:
        plans = [
            StepPlan(i, int32s([0]), int32s([i]), int32s([1]), int32s([1]), int64s([1]))
            for i in range(6)
        ]
        for plan in plans:
            device.launch(plan)
        device.launch_replay(plans[:2])
        results = []
        while len(results) < 7:
            select.select([device.completion_fd()], [], [], 10)
            results += device.collect()
    finally:
        device.close()
    assert [r.step_id for r in results] == [0, 1, 2, 3, 4, 5, -1]
    # Every step but the last was still unreported when its successor was launched.
    assert [int(r.tokens[0]) for r in results[:5]] == [1] * 5


# ------------------------------------------------------------------ memory
def test_the_kv_pool_gets_the_share_left_after_weights_a_step_and_other_processes():
    gib = 1 << 30
    blocks = blocks_that_fit(
        total=100 * gib, free=90 * gib, ours=2 * gib, peak=5 * gib, share=0.9, block_bytes=1 << 20
    )
    # 90 GiB allowed - 8 GiB of other processes - 5 GiB peak - the graphs' reserve.
    assert blocks == (77 * gib - RESERVE_BYTES) // (1 << 20)


def test_a_gpu_too_full_for_a_kv_pool_is_a_device_error_that_says_why():
    gib = 1 << 30
    with pytest.raises(DeviceError, match="gpu_memory_utilization 0.5 leaves no room"):
        blocks_that_fit(
            total=80 * gib, free=30 * gib, ours=gib, peak=2 * gib, share=0.5, block_bytes=1 << 20
        )


# ------------------------------------------------------------------ failures
def test_a_bad_plan_fails_its_step_alone(tiny):
    runner = pipelined_runner(tiny, cuda_graphs=False)
    greedy = SamplingParams(temperature=0, max_tokens=None)
    past_table = StepPlan(
        0,
        int32s([0]),
        int32s([0]),
        int32s([9]),
        int32s([1]),
        int64s(list(range(9))),
        [NewRow(0, greedy, list(range(9)), [])],
        new_blocks=int32s([0, 1]),
    )
    failed = runner.finish(runner.launch(past_table))
    assert failed.error and "block table" in failed.error
    fine = StepPlan(
        1,
        int32s([1]),
        int32s([0]),
        int32s([2]),
        int32s([1]),
        int64s([1, 2]),
        [NewRow(1, greedy, [1, 2], [])],
        new_blocks=int32s([1, 2]),
    )
    assert runner.finish(runner.launch(fine)).error is None


def test_a_lost_cuda_context_fails_the_device_not_the_step(tiny):
    runner = pipelined_runner(tiny, cuda_graphs=False)
    plan = first_step_plan()
    pending = runner.launch(plan)

    class Lost:
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    pending.copied = Lost()
    with pytest.raises(DeviceError, match="context is lost"):
        runner.finish(pending)
    assert runner._free.qsize() == SLOTS  # its slot came back all the same


def test_an_out_of_memory_step_fails_alone():
    oom = RuntimeError("CUDA error: out of memory")
    _raise_if_device_lost(oom)  # returns: the caller reports the step as failed
    _raise_if_device_lost(ValueError("CUDA error: but not a RuntimeError"))
    with pytest.raises(DeviceError):
        _raise_if_device_lost(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED"))


def test_a_device_process_whose_gpu_is_lost_exits_and_the_control_plane_sees_it(monkeypatch):
    import os
    import select
    import time
    from pathlib import Path

    from streams.device import DeviceSpec
    from streams.process_device import ProcessDevice

    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    import pipelined_fakes

    device = ProcessDevice(DeviceSpec(pipelined_fakes.build_lost_runner, threads=0))
    try:
        device.launch(StepPlan(0, int32s([0]), int32s([0]), int32s([1]), int32s([1]), int64s([1])))
        select.select([device.completion_fd()], [], [], 10)
        with pytest.raises(DeviceError, match="device process is gone"):
            device.collect()
        deadline = time.monotonic() + 10
        while device.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not device.alive()
    finally:
        device.kill()


@pytest.mark.parametrize(
    "message",
    [
        "Triton Error [CUDA]: an illegal memory access was encountered",
        "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered",
        "cudaErrorLaunchFailure: unspecified launch failure",
    ],
)
def test_triton_and_cupy_cuda_failures_lose_the_device(message):
    with pytest.raises(DeviceError, match="context is lost"):
        _raise_if_device_lost(RuntimeError(message))


def test_cupy_out_of_memory_fails_the_step_alone():
    _raise_if_device_lost(RuntimeError("CUDA_ERROR_OUT_OF_MEMORY: out of memory"))


def test_a_step_whose_forward_fails_frees_its_slot_only_once_the_device_is_done(tiny):
    runner = pipelined_runner(tiny, cuda_graphs=False)
    waits = []
    runner.sync.synchronize = lambda: waits.append(runner._free.qsize())

    def broken(*args):
        raise RuntimeError("the forward failed")

    runner.forward = broken
    failed = runner.finish(runner.launch(first_step_plan()))
    assert failed.error and "the forward failed" in failed.error
    assert waits == [SLOTS - 1]  # the device was waited for while the slot was still held
    assert runner._free.qsize() == SLOTS


def test_a_step_that_fails_before_the_device_rows_take_its_plan_loses_the_device(tiny):
    runner = pipelined_runner(tiny, cuda_graphs=False)

    def broken(plan):
        raise RuntimeError("the join failed")

    runner.rows.join = broken
    with pytest.raises(DeviceError, match="no longer the host's"):
        runner.launch(first_step_plan())
    assert runner._free.qsize() == SLOTS
