"""The pipelined (CUDA) runner, run on CPU tensors through the host stream/event shim.

What a GPU alone shows (real concurrency, graph capture, speed) is left to ``make gpu-check``;
what is checked here is the runner's logic: the same tokens as the synchronous ``ModelRunner``
with two steps in flight, device-side block tables and token buffer, padded decode buckets.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from plan_walk import PlanWalk
from tiny_models import make_tiny_llama

from async_engine.model.loader import build_model
from sampler.params import SamplingParams
from streams.device import DeviceError
from streams.pipeline import devsync
from streams.pipeline.clock import EventClock
from streams.pipeline.graphs import DecodeGraphs, bucket_sizes
from streams.pipeline.memory import RESERVE_BYTES, blocks_that_fit
from streams.pipeline.runner import SLOTS, PipelinedRunner, _raise_if_device_lost
from streams.plan import PLACEHOLDER, NewRow, StepPlan, int32s, int64s
from streams.runner import ModelRunner

# Triton's interpreter must be chosen before triton is first imported (its own jitted helpers
# are decorated then), and only for this import: see tests/test_triton_attention.py.
_BEFORE = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    from async_engine.model.gpu_kernels import paged_attention as interpreted_kernels
except ImportError:  # no triton: the Triton test is skipped
    interpreted_kernels = None
finally:
    if _BEFORE is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _BEFORE

BLOCK = 4
NUM_BLOCKS = 96
MAX_BLOCKS = 48
PARAMS = [
    SamplingParams(temperature=0, max_tokens=None),
    SamplingParams(temperature=0, max_tokens=None, logprobs=3),
    SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=None),
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=None, logprobs=0),
    SamplingParams(temperature=0, presence_penalty=0.5, repetition_penalty=1.3, max_tokens=None),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-pipeline")
    make_tiny_llama(folder, vocab=160, num_layers=2, hidden=64, heads=4, kv_heads=2)
    return str(folder)


def _model(folder: str):
    torch.manual_seed(0)
    return build_model(folder, "float32")


def _reference(folder: str) -> ModelRunner:
    return ModelRunner(_model(folder), NUM_BLOCKS, BLOCK, MAX_BLOCKS)


def _pipelined(folder: str, **options) -> PipelinedRunner:
    return PipelinedRunner(_model(folder), NUM_BLOCKS, BLOCK, MAX_BLOCKS, **options)


def _walk_both(folder: str, seed: int, steps: int, **options) -> tuple[list, list]:
    walk = PlanWalk(seed, 160, BLOCK, NUM_BLOCKS, PARAMS)
    return _walk(walk, _reference(folder), _pipelined(folder, **options), steps)


def _walk(walk: PlanWalk, reference: ModelRunner, runner: PipelinedRunner, steps: int):
    """Drive the reference synchronously and the pipelined runner two steps deep."""
    expected, got, in_flight = [], [], []
    for _ in range(steps):
        plan = walk.plan()
        result = reference.run(plan)
        assert result.error is None, result.error
        walk.record(plan, np.asarray(result.tokens))
        expected.append(result)
        if len(in_flight) == SLOTS:
            got.append(runner.finish(in_flight.pop(0)))
        in_flight.append(runner.launch(plan))
    got += [runner.finish(p) for p in in_flight]
    return expected, got


def _assert_same_results(expected: list, got: list) -> None:
    assert [r.step_id for r in got] == [r.step_id for r in expected]
    for want, have in zip(expected, got, strict=True):
        assert have.error is None, have.error
        assert np.asarray(have.tokens).tolist() == np.asarray(want.tokens).tolist(), want.step_id
        if want.logprobs is None:
            assert have.logprobs is None
        else:
            np.testing.assert_allclose(have.logprobs, want.logprobs, atol=1e-4)
            assert [[t for t, _ in row] for row in have.top_logprobs] == [
                [t for t, _ in row] for row in want.top_logprobs
            ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_steps_in_flight_give_the_synchronous_runners_tokens(tiny, seed):
    expected, got = _walk_both(tiny, seed, steps=60, cuda_graphs=False)
    assert sum(len(r.tokens) for r in expected) > 50  # the walk sampled plenty
    _assert_same_results(expected, got)


def test_decode_buckets_give_the_synchronous_runners_tokens(tiny):
    expected, got = _walk_both(tiny, 3, steps=60, cuda_graphs=True)
    _assert_same_results(expected, got)


def test_placeholder_reads_the_token_sampled_one_step_earlier_on_the_device(tiny):
    runner = _pipelined(tiny, cuda_graphs=False)
    greedy = SamplingParams(temperature=0, max_tokens=None)
    first = StepPlan(0, int32s([0]), int32s([0]), int32s([3]), np.array([True]),
                     int64s([5, 6, 7]), [NewRow(0, greedy, [5, 6, 7], [])],
                     new_blocks=int32s([0, 10]))  # fmt: skip
    second = StepPlan(1, int32s([0]), int32s([3]), int32s([1]), np.array([True]),
                      int64s([PLACEHOLDER]), new_blocks=int32s([0, 11]))  # fmt: skip
    pending = [runner.launch(first), runner.launch(second)]  # second before first finishes
    one, two = (runner.finish(p) for p in pending)

    reference = _reference(tiny)
    ref_one = reference.run(first)
    explicit = StepPlan(1, int32s([0]), int32s([3]), int32s([1]), np.array([True]),
                        int64s([int(ref_one.tokens[0])]), new_blocks=int32s([0, 11]))  # fmt: skip
    assert list(one.tokens) == list(ref_one.tokens)
    assert list(two.tokens) == list(reference.run(explicit).tokens)


def test_a_bad_plan_fails_its_step_alone(tiny):
    runner = _pipelined(tiny, cuda_graphs=False)
    greedy = SamplingParams(temperature=0, max_tokens=None)
    past_table = StepPlan(0, int32s([0]), int32s([0]), int32s([9]), np.array([True]),
                          int64s(list(range(9))), [NewRow(0, greedy, list(range(9)), [])],
                          new_blocks=int32s([0, 1]))  # fmt: skip
    failed = runner.finish(runner.launch(past_table))
    assert failed.error and "block table" in failed.error
    fine = StepPlan(1, int32s([1]), int32s([0]), int32s([2]), np.array([True]), int64s([1, 2]),
                    [NewRow(1, greedy, [1, 2], [])], new_blocks=int32s([1, 2]))  # fmt: skip
    assert runner.finish(runner.launch(fine)).error is None


def test_replay_runs_on_its_own_rows_and_leaves_the_live_ones(tiny):
    runner = _pipelined(tiny, cuda_graphs=False)
    walk = PlanWalk(5, 160, BLOCK, NUM_BLOCKS, PARAMS[:1])
    reference = _reference(tiny)
    plans = []
    for _ in range(12):
        plan = walk.plan()
        walk.record(plan, np.asarray(reference.run(plan).tokens))
        plans.append(plan)
    live = [runner.finish(runner.launch(p)) for p in plans[:6]]
    replayed = runner.replay(plans)
    assert replayed.step_id == -1 and replayed.device_end >= replayed.device_start
    rest = [runner.finish(runner.launch(p)) for p in plans[6:]]
    fresh = _reference(tiny)
    want = [fresh.run(p) for p in plans]
    assert [list(r.tokens) for r in live + rest] == [list(r.tokens) for r in want]


def test_step_times_are_on_the_host_monotonic_clock(tiny):
    import time

    runner = _pipelined(tiny, cuda_graphs=False)
    before = time.monotonic()
    greedy = SamplingParams(temperature=0, max_tokens=None)
    plan = StepPlan(0, int32s([0]), int32s([0]), int32s([2]), np.array([True]), int64s([1, 2]),
                    [NewRow(0, greedy, [1, 2], [])], new_blocks=int32s([0, 3]))  # fmt: skip
    result = runner.finish(runner.launch(plan))
    assert before <= result.device_start <= result.device_end <= time.monotonic()


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

    model = _model(tiny)
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
        batch = ForwardBatch(ids, pos, slots, [1] * live, ctx.tolist(), tables,
                             torch.arange(live))  # fmt: skip
        want = model(batch, kv)
        written = [k.clone() for k, _ in kv]
        for (k, _), old in zip(kv, before, strict=True):
            k.copy_(old)  # the padded run writes the same slots again
        got = graphs.run(ids, pos, slots, ctx, ctx.tolist(), tables, torch.arange(live))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for (k, _), ref in zip(kv, written, strict=True):
            # Padding wrote only the dummy block; every real block is as the unpadded run left it.
            torch.testing.assert_close(k[:blocks], ref[:blocks], atol=0, rtol=0)


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
    host = iter([100.0, 100.5, 103.0])
    clock = EventClock(FakeSync([5000.0]), now=lambda: next(host))
    clock.anchor()  # device 5000 ms == host 100 s
    assert clock.to_host(FakeEvent(5250.0)) == pytest.approx(100.25)
    assert clock.to_host(FakeEvent(4990.0)) == pytest.approx(99.99)
    assert not clock.anchor_due()  # host 100.5: half a second after the anchor
    assert clock.anchor_due()  # host 103.0


def test_gaps_between_steps_come_from_the_events_alone():
    host = iter([50.0])
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
            StepPlan(i, int32s([0]), int32s([i]), int32s([1]), np.array([True]), int64s([1]))
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


# ------------------------------------------------------------------ memory and failure
def test_the_kv_pool_gets_the_share_left_after_weights_a_step_and_other_processes():
    gib = 1 << 30
    blocks = blocks_that_fit(total=100 * gib, free=90 * gib, ours=2 * gib, peak=5 * gib,
                             share=0.9, block_bytes=1 << 20)  # fmt: skip
    # 90 GiB allowed - 8 GiB of other processes - 5 GiB peak - the graphs' reserve.
    assert blocks == (77 * gib - RESERVE_BYTES) // (1 << 20)


def test_a_gpu_too_full_for_a_kv_pool_is_a_device_error_that_says_why():
    gib = 1 << 30
    with pytest.raises(DeviceError, match="gpu_memory_utilization 0.5 leaves no room"):
        blocks_that_fit(total=80 * gib, free=30 * gib, ours=gib, peak=2 * gib, share=0.5,
                        block_bytes=1 << 20)  # fmt: skip


def test_a_lost_cuda_context_fails_the_device_not_the_step(tiny):
    runner = _pipelined(tiny, cuda_graphs=False)
    greedy = SamplingParams(temperature=0, max_tokens=None)
    plan = StepPlan(0, int32s([0]), int32s([0]), int32s([2]), np.array([True]), int64s([1, 2]),
                    [NewRow(0, greedy, [1, 2], [])], new_blocks=int32s([0, 3]))  # fmt: skip
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
        device.launch(StepPlan(0, int32s([0]), int32s([0]), int32s([1]), np.array([True]),
                               int64s([1])))  # fmt: skip
        select.select([device.completion_fd()], [], [], 10)
        with pytest.raises(DeviceError, match="device process is gone"):
            device.collect()
        deadline = time.monotonic() + 10
        while device.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not device.alive()
    finally:
        device.kill()


# ------------------------------------------------------------------ Triton attention
def test_the_triton_attention_path_gives_the_synchronous_runners_tokens(tiny, monkeypatch):
    """The CUDA configuration's attention (device-side plans, decode buckets) under Triton's
    interpreter: prefill chunks, then decodes through the padded static buffers."""
    if interpreted_kernels is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreted_kernels.INTERPRETED
    greedy = SamplingParams(temperature=0, max_tokens=None)
    prompts = {0: [3, 1, 4, 1, 5, 9, 2, 6, 5], 1: [2, 7, 1, 8, 2, 8]}
    plans = [
        StepPlan(0, int32s([0, 1]), int32s([0, 0]), int32s([5, 6]), np.array([False, True]),
                 int64s(prompts[0][:5] + prompts[1]),
                 [NewRow(r, greedy, p, []) for r, p in prompts.items()],
                 new_blocks=int32s([0, 7, 1, 3])),
        StepPlan(1, int32s([0, 1]), int32s([5, 6]), int32s([4, 1]), np.array([True, True]),
                 int64s(prompts[0][5:] + [PLACEHOLDER])),
    ]  # fmt: skip
    for step in range(2, 5):
        plans.append(StepPlan(step, int32s([0, 1]), int32s([7 + step, 5 + step]), int32s([1, 1]),
                              np.array([True, True]), int64s([PLACEHOLDER, PLACEHOLDER])))  # fmt: skip
    reference = ModelRunner(_model(tiny), 16, 16, 4)
    runner = PipelinedRunner(_model(tiny), 16, 16, 4, attention="triton", graph_max_batch=4)
    pending = [runner.launch(p) for p in plans[:2]]
    got = [runner.finish(pending.pop(0))]
    for plan in plans[2:]:
        pending.append(runner.launch(plan))
        got.append(runner.finish(pending.pop(0)))
    got += [runner.finish(p) for p in pending]
    want = [reference.run(p) for p in plans]
    assert [r.error for r in got] == [None] * len(plans)
    assert [list(r.tokens) for r in got] == [list(r.tokens) for r in want]


# ------------------------------------------------------------------ through the engine
@pytest.mark.parametrize("overlap", [True, False])
def test_the_engine_on_the_pipelined_runner_streams_the_synchronous_runners_text(
    tiny_model, overlap
):
    """Default tiny model (a real tokenizer): greedy, seeded sampling, logprobs, stop strings
    and structured output (the host-synchronised grammar step) through the whole engine."""
    from async_engine import LLM

    json_row = SamplingParams(
        temperature=0, max_tokens=24, structured_output=("json_schema", '{"type": "object"}')
    )
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=20, logprobs=2),
        json_row,
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, min_tokens=5),
    ]
    prompts = ["The lighthouse keeper", "Once upon a time", "A JSON object:", "x" * 300]
    outs = {}
    for runner in ("sync", "pipelined"):
        with LLM(str(tiny_model), dtype="float32", device="cpu", overlap=overlap,
                 device_runner=runner, max_num_batched_tokens=64) as llm:  # fmt: skip
            outs[runner] = [
                (o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(prompts, params)
            ]
    assert [t for t, _ in outs["pipelined"]] == [t for t, _ in outs["sync"]]
    assert all(len(t) > 0 for t, _ in outs["sync"])


# ------------------------------------------------------------------ on a GPU (make gpu-check)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _cuda_walk(folder: str, graphs: bool, steps: int = 40) -> list:
    runner = PipelinedRunner(build_model(folder, "float32", "cuda"), NUM_BLOCKS, 16, MAX_BLOCKS,
                             "cuda", cuda_graphs=graphs, graph_max_batch=8)  # fmt: skip
    reference = ModelRunner(_model(folder), NUM_BLOCKS, 16, MAX_BLOCKS)
    walk = PlanWalk(9, 160, 16, NUM_BLOCKS, PARAMS)
    torch.cuda.set_sync_debug_mode("error")  # any host sync in a step raises
    try:
        return _walk(walk, reference, runner, steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_on_cuda_two_steps_in_flight_give_the_cpu_runners_tokens_without_host_syncs(tiny, graphs):
    expected, got = _cuda_walk(tiny, graphs)
    _assert_same_results(expected, got)


@pytest.mark.cuda
@needs_gpu
def test_on_cuda_step_times_come_from_events_on_the_host_clock(tiny):
    import time

    runner = PipelinedRunner(build_model(tiny, "float32", "cuda"), 16, 16, 4, "cuda")
    greedy = SamplingParams(temperature=0, max_tokens=None)
    before = time.monotonic()
    plan = StepPlan(0, int32s([0]), int32s([0]), int32s([2]), np.array([True]), int64s([1, 2]),
                    [NewRow(0, greedy, [1, 2], [])], new_blocks=int32s([0, 3]))  # fmt: skip
    result = runner.finish(runner.launch(plan))
    assert before - 0.01 <= result.device_start < result.device_end <= time.monotonic() + 0.01
