"""The model runner, run on CPU tensors through the host stream/event shim, gives the tokens
of a reference that recomputes every sequence from scratch (``tests/recompute_runner.py``):
two steps in flight, PLACEHOLDER inputs filled from the device token buffer, padded decode
buckets, replays on rows of their own, Triton attention under its interpreter, and the
whole engine.

What a GPU alone shows (real concurrency, graph capture, speed) is left to ``make gpu-check``,
which runs the cuda-marked tests at the end. The runner's parts and its failures are checked in
tests/test_pipelined_runner_parts.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from pipelined_runs import (
    BLOCK,
    MAX_BLOCKS,
    NUM_BLOCKS,
    PARAMS,
    AheadLookahead,
    LookaheadDrafter,
    assert_same_results,
    first_step_plan,
    make_tiny_model,
    pipelined_runner,
    reference_runner,
    seeded_model,
    walk_both,
    walk_chain_drafts,
    walk_device_drafts,
    walk_two_deep,
)
from plan_walk import PlanWalk
from recompute_runner import RecomputeRunner

from async_engine.model.loader import build_model
from sampler.params import SamplingParams
from streams.pipeline.devsync import DeviceSync
from streams.pipeline.runner import PipelinedRunner
from streams.plan import PLACEHOLDER, NewRow, StepPlan, int32s, int64s

# Triton's interpreter must be chosen before triton is first imported (its own jitted helpers
# are decorated then), and only for this import: see tests/test_triton_attention.py. Never
# where a GPU is: the module is the process's one, and the CUDA runner of the cuda-marked
# tests below would launch the interpreted kernels (make gpu-check runs them compiled).
interpreted_kernels = None
NO_INTERPRETER = "triton is not installed"
if torch.cuda.is_available():
    NO_INTERPRETER = "a CUDA device is present: the kernels run compiled there, not interpreted"
else:
    _BEFORE = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from async_engine.model.gpu_kernels import paged_attention as interpreted_kernels
    except ImportError:  # no triton: the Triton tests are skipped
        pass
    finally:
        if _BEFORE is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _BEFORE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-pipeline"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_steps_in_flight_give_the_references_tokens(tiny, seed):
    expected, got = walk_both(tiny, seed, steps=60, cuda_graphs=False)
    assert sum(len(r.tokens) for r in expected) > 50  # the walk sampled plenty
    assert_same_results(expected, got)


@pytest.mark.parametrize("seed", [0, 1])
def test_rows_drafting_on_the_device_emit_what_one_token_at_a_time_decoding_emits(
    tiny, seed, deferred
):
    """Drafts made inside the step from the device's copy of the rows' tokens, verified
    there: runs of every length kept, two steps in flight. (Attention planned on the host
    waits for a verify step's counts: a step after one drafts on the host instead.)"""
    expected, got, runner = walk_device_drafts(tiny, seed, steps=60, cuda_graphs=False)
    runs = [c for r in expected for c in r.emitted(0).tolist()]
    assert max(runs) == 5 and 1 in runs
    assert sum(deferred) > 0 and runner.drafter.host_steps > 0
    assert_same_results(expected, got)
    assert runner.rows.host.unsettled.sum() == 0  # every count came back


def test_the_ngram_drafter_on_the_device_drafts_what_its_numpy_twin_drafts(tiny, deferred):
    expected, got, _ = walk_device_drafts(tiny, 0, steps=60, ngram=True, cuda_graphs=False)
    assert sum(deferred) > 0
    assert sum(int(r.drafted.sum()) for r in got if r.drafted is not None) > 20
    assert_same_results(expected, got)


def test_a_serial_device_drafts_on_the_host(tiny, monkeypatch):
    """On the serial twin (a CPU) the rows' tokens are on the host at launch: drafts are made
    there, as many as each row's match found (the device's would fill every slot)."""
    from streams.pipeline import runner

    def on_device(*args):
        raise AssertionError("drafted on the device")

    monkeypatch.setattr(runner, "draft", on_device)
    expected, got, _ = walk_device_drafts(tiny, 0, steps=60, ngram=True, cuda_graphs=False)
    assert sum(int(r.drafted.sum()) for r in got if r.drafted is not None) > 20
    assert_same_results(expected, got)


@pytest.mark.parametrize("seed", [0, 1])
def test_drafts_made_ahead_over_steps_in_flight_are_kept_where_they_follow_the_rows_tokens(
    tiny, seed, deferred
):
    """A host drafter drafts ahead, from the tokens the host has, past those of the step in
    flight: the device keeps the drafts where the chain foresaw that step's tokens (the
    reference keeps the same ones by the numpy rule), and none where it did not."""
    expected, got, recorder = walk_chain_drafts(tiny, seed, steps=60, drafter=AheadLookahead)
    runs = [c for r in expected for c in r.emitted(0).tolist()]
    assert max(runs) == 5 and 1 in runs
    assert sum(deferred) > 0 and recorder.kept_ahead > 20
    assert sum(int(r.drafted.sum()) for r in got if r.drafted is not None) > 20
    assert_same_results(expected, got)


def test_the_suffix_drafter_drafts_ahead_of_the_step_in_flight(tiny, deferred):
    """Its steps are laid out without waiting for its rows' last tokens, and where its chain
    missed them, prompt lookup drafts on the device (the walk's random text gives suffix
    decoding little to foresee: its rule is checked above)."""
    from streams.drafting.ngram import NgramDrafter
    from streams.drafting.suffix import SuffixDrafter

    def suffix(reference):
        return SuffixDrafter(max_tree_depth=8, max_cached_requests=8, max_spec_factor=2.0,
                             min_token_prob=0.1, missed=NgramDrafter(1, 3))  # fmt: skip

    expected, got, recorder = walk_chain_drafts(tiny, 0, steps=60, drafter=suffix)
    assert sum(deferred) > 0 and recorder.missed_chains > 10
    assert sum(int(r.drafted.sum()) for r in got if r.drafted is not None) > 20
    assert_same_results(expected, got)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_verifying_drafts_emit_what_one_token_at_a_time_decoding_emits(tiny, seed):
    """Greedy, seeded, penalised and logprob rows with 1-4 draft slots, some from RESOLVE
    starts, beside prompt chunks and preemptions, two steps in flight."""
    expected, got = walk_both(tiny, seed, steps=60, max_drafts=4, cuda_graphs=False)
    runs = [c for r in expected for c in r.emitted(0).tolist()]
    assert max(runs) == 5 and 1 in runs  # four drafts kept with the token after; cut short
    assert_same_results(expected, got)


def test_decode_buckets_give_the_references_tokens(tiny):
    expected, got = walk_both(tiny, 3, steps=60, cuda_graphs=True, eager_buckets=True)
    assert_same_results(expected, got)


@pytest.fixture
def verify_bucket_steps(monkeypatch) -> list[bool]:
    """Whether each step through the padded buckets ran several tokens a row."""
    from streams.pipeline.graphs import DecodeGraphs

    steps: list[bool] = []
    run = DecodeGraphs.run

    def counted(self, *args, **kwargs):
        steps.append(len(args) > 7 and args[7] is not None)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    return steps


def test_verify_buckets_give_the_references_tokens(tiny, verify_bucket_steps):
    """Rows verifying 1-4 drafts through the padded buckets of 5 tokens a row (eager here;
    captured on a GPU), two steps in flight."""
    expected, got = walk_both(
        tiny, 4, steps=60, max_drafts=4, cuda_graphs=True, eager_buckets=True,
        graph_tokens_per_row=5,
    )  # fmt: skip
    assert sum(verify_bucket_steps) >= 5, "steps of several tokens a row ran in the buckets"
    assert_same_results(expected, got)


def test_placeholder_reads_the_token_sampled_one_step_earlier_on_the_device(tiny):
    runner = pipelined_runner(tiny, cuda_graphs=False)
    greedy = SamplingParams(temperature=0, max_tokens=None)
    first = StepPlan(
        0,
        int32s([0]),
        int32s([0]),
        int32s([3]),
        int32s([1]),
        int64s([5, 6, 7]),
        [NewRow(0, greedy, [5, 6, 7], [])],
        new_blocks=int32s([0, 10]),
    )
    second = StepPlan(
        1,
        int32s([0]),
        int32s([3]),
        int32s([1]),
        int32s([1]),
        int64s([PLACEHOLDER]),
        new_blocks=int32s([0, 11]),
    )
    pending = [runner.launch(first), runner.launch(second)]  # second before first finishes
    one, two = (runner.finish(p) for p in pending)

    reference = reference_runner(tiny)
    ref_one = reference.run(first)
    explicit = StepPlan(
        1,
        int32s([0]),
        int32s([3]),
        int32s([1]),
        int32s([1]),
        int64s([int(ref_one.tokens[0])]),
        new_blocks=int32s([0, 11]),
    )
    assert list(one.tokens) == list(ref_one.tokens)
    assert list(two.tokens) == list(reference.run(explicit).tokens)


def test_replay_runs_on_its_own_rows_and_leaves_the_live_ones(tiny):
    runner = pipelined_runner(tiny, cuda_graphs=False)
    walk = PlanWalk(5, 160, BLOCK, NUM_BLOCKS, PARAMS[:1])
    reference = reference_runner(tiny)
    plans = []
    for _ in range(12):
        plan = walk.plan()
        walk.record(plan, reference.run(plan))
        plans.append(plan)
    live = [runner.finish(runner.launch(p)) for p in plans[:6]]
    replayed = runner.replay(plans)
    assert replayed.step_id == -1 and replayed.device_end >= replayed.device_start
    rest = [runner.finish(runner.launch(p)) for p in plans[6:]]
    fresh = reference_runner(tiny)
    want = [fresh.run(p) for p in plans]
    assert [list(r.tokens) for r in live + rest] == [list(r.tokens) for r in want]


def test_step_times_are_on_the_host_monotonic_clock(tiny):
    import time

    runner = pipelined_runner(tiny, cuda_graphs=False)
    before = time.monotonic()
    plan = first_step_plan()
    result = runner.finish(runner.launch(plan))
    assert before <= result.device_start <= result.device_end <= time.monotonic()


# ------------------------------------------------------------------ Triton attention
def test_the_triton_attention_path_gives_the_references_tokens(tiny, monkeypatch):
    """The CUDA configuration's attention (device-side plans, decode buckets) under Triton's
    interpreter: prefill chunks, then decodes through the padded static buffers."""
    if interpreted_kernels is None:
        pytest.skip(NO_INTERPRETER)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreted_kernels.INTERPRETED
    greedy = SamplingParams(temperature=0, max_tokens=None)
    prompts = {0: [3, 1, 4, 1, 5, 9, 2, 6, 5], 1: [2, 7, 1, 8, 2, 8]}
    plans = [
        StepPlan(
            0,
            int32s([0, 1]),
            int32s([0, 0]),
            int32s([5, 6]),
            int32s([0, 1]),
            int64s(prompts[0][:5] + prompts[1]),
            [NewRow(r, greedy, p, []) for r, p in prompts.items()],
            new_blocks=int32s([0, 7, 1, 3]),
        ),
        StepPlan(
            1,
            int32s([0, 1]),
            int32s([5, 6]),
            int32s([4, 1]),
            int32s([1, 1]),
            int64s(prompts[0][5:] + [PLACEHOLDER]),
        ),
    ]
    for step in range(2, 5):
        plans.append(
            StepPlan(
                step,
                int32s([0, 1]),
                int32s([7 + step, 5 + step]),
                int32s([1, 1]),
                int32s([1, 1]),
                int64s([PLACEHOLDER, PLACEHOLDER]),
            )
        )
    reference = RecomputeRunner(seeded_model(tiny))
    runner = PipelinedRunner(
        seeded_model(tiny), 16, 16, 4, attention="triton", graph_max_batch=4, eager_buckets=True
    )
    pending = [runner.launch(p) for p in plans[:2]]
    got = [runner.finish(pending.pop(0))]
    for plan in plans[2:]:
        pending.append(runner.launch(plan))
        got.append(runner.finish(pending.pop(0)))
    got += [runner.finish(p) for p in pending]
    want = [reference.run(p) for p in plans]
    assert [r.error for r in got] == [None] * len(plans)
    assert [list(r.tokens) for r in got] == [list(r.tokens) for r in want]


@pytest.mark.parametrize("buckets", [False, True], ids=["varlen", "verify-buckets"])
def test_rows_of_several_tokens_under_triton_attention_give_the_references_tokens(
    tiny, monkeypatch, verify_bucket_steps, buckets
):
    """Rows verifying 1-4 drafts beside prompt chunks through the Triton kernels under the
    interpreter: the varlen kernel with several query tokens a row, and the padded verify
    buckets the CUDA graphs capture."""
    if interpreted_kernels is None:
        pytest.skip(NO_INTERPRETER)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    options = {"attention": "triton", "graph_max_batch": 8}
    if buckets:
        options |= {"cuda_graphs": True, "eager_buckets": True, "graph_tokens_per_row": 5}
    expected, got = walk_both(tiny, 5, steps=24, max_drafts=4, block=16, **options)
    assert (sum(verify_bucket_steps) >= 3) == buckets
    assert max(c for r in expected for c in r.emitted(0).tolist()) > 1  # drafts were kept
    assert_same_results(expected, got)


class DeferredSync(DeviceSync):
    """The host twin taking the GPU's paths: a step's tokens are taken into the host rows
    when it is finished, not at launch, so the next step meets counts the host lacks."""

    serial = False


@pytest.fixture
def deferred(monkeypatch) -> list[int]:
    """Runners made in the test on ``DeferredSync`` (where drafting on the device spares a
    wait: on the serial twin the host has the tokens at once and drafts itself); the rows
    each step drafted for on the device, into the list."""
    from streams.pipeline import devsync, runner

    monkeypatch.setattr(devsync, "for_device", lambda device: DeferredSync(torch.device(device)))
    drafted, draft = [], runner.draft

    def counted(dev, *args):
        drafted.append(int(dev["draft_rows"].numel()))
        return draft(dev, *args)

    monkeypatch.setattr(runner, "draft", counted)
    return drafted


@pytest.mark.parametrize("buckets", [False, True], ids=["varlen", "verify-buckets"])
def test_rows_whose_counts_the_host_lacks_start_where_the_devices_counts_end(
    tiny, monkeypatch, deferred, buckets
):
    """Two steps in flight, drafts made and verified on the device, Triton's attention (planned
    on the device): a row's next step is laid out before its verify step's counts reach the
    host, and the device moves it to where its verified run ended."""
    if interpreted_kernels is None:
        pytest.skip(NO_INTERPRETER)
    from streams.pipeline import runner

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    resolved, resolve = [], runner.resolve_starts

    def counted(dev, *args):
        resolved.append(int(dev["resolve"].sum()))
        return resolve(dev, *args)

    monkeypatch.setattr(runner, "resolve_starts", counted)
    options = {"attention": "triton", "graph_max_batch": 8}
    if buckets:
        options |= {"cuda_graphs": True, "eager_buckets": True, "graph_tokens_per_row": 5}
    expected, got, pipelined = walk_device_drafts(tiny, 2, steps=30, block=16, **options)
    assert sum(resolved) >= 10 and pipelined.drafter.host_steps == 0
    assert max(c for r in expected for c in r.emitted(0).tolist()) > 2
    assert_same_results(expected, got)


@pytest.fixture
def launched_variants(monkeypatch) -> list[set]:
    """Each Triton attention launch's specialisation key (the variant triton compiles on an
    H200), into the last set of the list: append a set to start a new phase."""
    from async_engine.model.gpu_kernels import aot

    phases: list[set] = [set()]

    def record(name: str) -> None:
        kernel = getattr(interpreted_kernels, name)
        key = aot.launch_keys(kernel)

        class Recording:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    phases[-1].add((name, key(*args, **kwargs)))
                    return kernel[grid](*args, **kwargs)

                return launch

        monkeypatch.setattr(interpreted_kernels, name, Recording())

    record("paged_decode_kernel")
    record("paged_varlen_kernel")
    return phases


def test_serving_launches_only_the_triton_variants_warmed_at_start(
    tiny, monkeypatch, launched_variants, verify_bucket_steps
):
    """A variant compiles in 0.2-1.4 s on an H200: serving must not meet a new one. Prompt
    chunks, decodes (block tables as wide as each step needs), rows verifying drafts and the
    padded buckets launch only what the runners' start launched (aligned sections, the
    block tables' stride unspecialised)."""
    if interpreted_kernels is None:
        pytest.skip(NO_INTERPRETER)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    buckets = {"cuda_graphs": True, "eager_buckets": True, "graph_tokens_per_row": 5}
    reference = reference_runner(tiny)
    drafter = LookaheadDrafter(reference)
    verifying = pipelined_runner(
        tiny, 16, drafter=drafter, attention="triton", graph_max_batch=8, **buckets
    )
    decoding = pipelined_runner(tiny, 16, attention="triton", cuda_graphs=False)
    warmed = launched_variants[-1]
    launched_variants.append(set())
    walk = PlanWalk(6, 160, 16, NUM_BLOCKS, PARAMS, 4)
    walk_two_deep(walk, reference, verifying, 16, drafter)
    walk_two_deep(PlanWalk(7, 160, 16, NUM_BLOCKS, PARAMS), reference_runner(tiny), decoding, 16)
    served = launched_variants[-1]
    assert any(verify_bucket_steps)  # rows of several tokens ran in the padded buckets
    assert {name for name, _ in served} == {"paged_decode_kernel", "paged_varlen_kernel"}
    assert served <= warmed, f"compiled while serving: {served - warmed}"


# ------------------------------------------------------------------ through the engine
def test_the_engine_streams_the_same_tokens_with_overlap_on_and_off(tiny_model):
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
    for overlap in (True, False):
        with LLM(
            str(tiny_model),
            dtype="float32",
            device="cpu",
            overlap=overlap,
            max_num_batched_tokens=64,
        ) as llm:
            outs[overlap] = [
                (o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(prompts, params)
            ]
    assert [t for t, _ in outs[True]] == [t for t, _ in outs[False]]
    assert all(len(t) > 0 for t, _ in outs[False])


# ------------------------------------------------------------------ on a GPU (make gpu-check)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _cuda_walk(folder: str, graphs: bool, steps: int = 40) -> list:
    runner = PipelinedRunner(
        build_model(folder, "float32", "cuda"),
        NUM_BLOCKS,
        16,
        MAX_BLOCKS,
        "cuda",
        cuda_graphs=graphs,
        graph_max_batch=8,
    )
    reference = RecomputeRunner(seeded_model(folder))
    walk = PlanWalk(9, 160, 16, NUM_BLOCKS, PARAMS)
    torch.cuda.set_sync_debug_mode("error")  # any host sync in a step raises
    try:
        return walk_two_deep(walk, reference, runner, steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_on_cuda_two_steps_in_flight_give_the_cpu_runners_tokens_without_host_syncs(tiny, graphs):
    expected, got = _cuda_walk(tiny, graphs)
    assert_same_results(expected, got)


@pytest.mark.cuda
@needs_gpu
def test_on_cuda_step_times_come_from_events_on_the_host_clock(tiny):
    import time

    runner = PipelinedRunner(build_model(tiny, "float32", "cuda"), 16, 16, 4, "cuda")
    before = time.monotonic()
    plan = first_step_plan()
    result = runner.finish(runner.launch(plan))
    assert before - 0.01 <= result.device_start < result.device_end <= time.monotonic() + 0.01
