"""Profiling: the step tracer, the idle-gap report, Chrome/nsys formats, the profile command."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from itertools import pairwise
from pathlib import Path

import pytest

from async_engine.core.observer import PHASES
from async_engine.core.timeline import DeviceTimeline
from profiling.chrome import from_chrome, load_chrome, to_chrome, validate
from profiling.nsys import load_nsys
from profiling.report import DEVICE_SIDE, UNTRACED, analyze
from profiling.trace import DeviceSpan, PhaseSpan, Trace
from profiling.tracer import StepTracer
from sampler.params import SamplingParams
from streams.plan import StepResult

ROOT = Path(__file__).resolve().parents[1]


def decode(step: int, start: float, end: float, batch: int = 4, after_idle: bool = False):
    return DeviceSpan(step, start, end, batch, batch, 0, batch, after_idle)


def prefill(step: int, start: float, end: float, tokens: int = 40):
    return DeviceSpan(step, start, end, 4, tokens, tokens, 0, False)


# ------------------------------------------------------------------ live engine
@pytest.fixture(scope="module", params=[True, False], ids=["overlap-on", "overlap-off"])
def traced_run(request, tiny_model):
    from async_engine.core.llm import LLM

    with LLM(model=str(tiny_model), dtype="float32", device="cpu", overlap=request.param) as llm:
        # Plan each step as soon as the one before is launched, however long steps take on
        # this machine (planning near the end of long steps is test_step_planning's).
        llm.engine.clock.planning = "overlap"
        tracer = StepTracer.attach(llm.engine)
        prompts = [[100 + i] * (5 + 3 * i) for i in range(4)]
        llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        llm.engine.observer = None
    return request.param, tracer.snapshot(), prompts


def test_every_step_has_its_phases_in_loop_order_around_its_device_span(traced_run):
    _, trace, _ = traced_run
    assert trace.device, "no device steps were traced"
    assert {p.name for p in trace.phases} == set(PHASES)
    by_step: dict[int, dict[str, PhaseSpan]] = {}
    for p in trace.phases:
        assert p.start <= p.end
        assert p.name not in by_step.setdefault(p.step, {}), "one span per phase per step"
        by_step[p.step][p.name] = p
    for d in trace.device:
        ph = by_step[d.step]
        assert ph["schedule"].end <= ph["launch"].start <= d.start <= d.end <= ph["wait"].end
        assert ph["wait"].end <= ph["apply"].start <= ph["apply"].end <= ph["stream"].start


def test_device_spans_are_ordered_and_never_overlap(traced_run):
    _, trace, _ = traced_run
    steps = [d.step for d in trace.device]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    for prev, cur in pairwise(trace.device):
        assert prev.end <= cur.start


def test_overlap_launches_the_next_step_before_waiting_and_sync_mode_after_streaming(traced_run):
    overlap, trace, _ = traced_run
    phase = {(p.step, p.name): p for p in trace.phases}
    for prev, cur in pairwise(trace.device):
        launch_next = phase[(cur.step, "launch")]
        if overlap:
            assert launch_next.end <= phase[(prev.step, "wait")].start
        else:
            assert launch_next.start >= phase[(prev.step, "stream")].end


def test_device_spans_carry_batch_size_and_the_prefill_decode_mix(traced_run):
    _, trace, prompts = traced_run
    first = trace.device[0]
    assert first.batch == 4 and first.prefill_tokens == sum(map(len, prompts))
    assert first.decode_tokens == 0
    steady = trace.device[2:-1]
    assert steady and all(d.is_decode and d.tokens == d.batch == 4 for d in steady)


def test_the_ring_buffer_keeps_only_the_newest_spans():
    from streams.plan import StepPlan, int32s, int64s

    tracer = StepTracer(capacity=10, nvtx=False)
    plan = StepPlan(0, int32s([0]), int32s([3]), int32s([1]), int32s([1]), int64s([-1]))
    for step in range(25):
        plan.step_id = step
        tracer.on_phase("schedule", step, step, step + 0.1)
        tracer.on_device(plan, StepResult(step, [1], device_start=step, device_end=step + 0.5))
    trace = tracer.snapshot()
    assert len(tracer) == 10 and [d.step for d in trace.device] == list(range(15, 25))
    assert [p.step for p in trace.phases] == list(range(15, 25))


# ------------------------------------------------------------------ report on constructed traces
def test_idle_fraction_matches_the_hand_computed_value_and_the_engine_timeline():
    device = [
        prefill(0, 0, 10),
        decode(1, 12, 20),
        decode(2, 21, 30),
        decode(3, 34, 40),
        decode(4, 100, 110, after_idle=True),
    ]
    report = analyze(Trace(device=device))
    # busy 10+8+9+6+10 = 43; idle 2+1+4 = 7; the 60 s before step 4 had no work to do.
    assert report.busy_s == pytest.approx(43)
    assert report.idle_s == pytest.approx(7)
    assert report.engine_idle_s == pytest.approx(60)
    assert report.idle_fraction == pytest.approx(7 / 50)
    # steady decode pairs (1,2), (2,3), (3,4): busy 9+6+10, idle 1+4.
    assert report.decode_idle_fraction == pytest.approx(5 / 30)
    timeline = DeviceTimeline()
    for span in device:
        if span.after_idle:
            timeline.mark_idle_engine()
        timeline.on_launch(span.step, span.start)
        timeline.on_result(StepResult(span.step, [], device_start=span.start, device_end=span.end))
    assert timeline.idle_fraction() == pytest.approx(report.idle_fraction)


def test_each_gap_is_blamed_on_the_phase_that_covered_most_of_it():
    device = [decode(0, 0, 10), decode(1, 14, 20), decode(2, 25, 30), decode(3, 31, 40)]
    phases = [
        PhaseSpan("wait", 0, 1, 10.5),
        PhaseSpan("apply", 0, 10.5, 11),
        PhaseSpan("stream", 0, 11, 11.5),
        PhaseSpan("schedule", 1, 11.5, 13.5),
        PhaseSpan("launch", 1, 13.5, 13.8),  # gap 10..14: schedule 2 s of 4
        PhaseSpan("stream", 1, 20.5, 24),  # gap 20..25: stream 3.5 s of 5
        PhaseSpan("apply", 2, 30.9, 31),  # gap 30..31: nothing ran for 0.9 s of 1
    ]
    report = analyze(Trace(phases, device))
    assert [g.blame for g in report.gaps] == ["schedule", "stream", UNTRACED]
    assert report.gaps[0].overlaps == pytest.approx(
        {"wait": 0.5, "apply": 0.5, "stream": 0.5, "schedule": 2, "launch": 0.3, UNTRACED: 0.2}
    )
    assert report.blame_seconds()["stream"] == pytest.approx(4.0)
    assert report.blame_counts() == {"schedule": 1, "stream": 1, UNTRACED: 1}
    count, p50, _, top = report.gap_stats()
    assert (count, p50, top) == (3, pytest.approx(4), pytest.approx(5))


def test_a_gap_with_the_next_plan_already_launched_is_blamed_on_the_device_side():
    device = [decode(0, 0, 10), decode(1, 11, 20)]
    phases = [PhaseSpan("launch", 1, 5, 5.2), PhaseSpan("wait", 0, 5.5, 10.8)]
    (gap,) = analyze(Trace(phases, device)).gaps
    assert gap.blame == DEVICE_SIDE and gap.overlaps == pytest.approx({DEVICE_SIDE: 1})


def test_phase_time_hidden_behind_the_device_is_the_part_overlapping_busy_spans():
    device = [decode(0, 0, 10), decode(1, 12, 20)]
    phases = [PhaseSpan("schedule", 1, 8, 12), PhaseSpan("schedule", 2, 15, 16)]
    stat = analyze(Trace(phases, device)).phases[0]
    assert (stat.total_s, stat.hidden_s, stat.steps) == (5, 3, 2)


# ------------------------------------------------------------------ Chrome trace
def constructed_trace() -> Trace:
    device = [prefill(0, 100.0, 100.010), decode(1, 100.012, 100.0201)]
    phases = [
        PhaseSpan("schedule", 0, 99.999, 100.0),
        PhaseSpan("wait", 0, 100.0, 100.0105),
        PhaseSpan("schedule", 1, 100.0106, 100.0115),
    ]
    return Trace(phases, device)


def test_chrome_trace_passes_the_schema_check_with_separate_tracks_in_microseconds():
    trace = constructed_trace()
    doc = json.loads(json.dumps(to_chrome(trace, analyze(trace).gaps)))
    assert validate(doc) == []
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans if e["cat"] == "control"} == {1}
    assert {e["tid"] for e in spans if e["cat"] == "device"} == {2}
    assert {e["tid"] for e in spans if e["cat"] == "gap"} == {3}
    first_step = next(e for e in spans if e["name"] == "step 0")
    assert first_step["ts"] == pytest.approx(1000) and first_step["dur"] == pytest.approx(10_000)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"control plane", "device", "device idle"}


def test_chrome_trace_round_trips(tmp_path):
    from profiling.chrome import write_chrome

    trace = constructed_trace()
    loaded = load_chrome(write_chrome(trace, tmp_path / "trace.json", analyze(trace).gaps))
    assert [p[:2] for p in loaded.phases] == [p[:2] for p in trace.phases]
    assert [d[3:] for d in loaded.device] == [d[3:] for d in trace.device]
    for got, want in zip(loaded.phases + loaded.device, trace.phases + trace.device, strict=True):
        assert (got.start, got.end) == pytest.approx((want.start, want.end), abs=1e-9)


def test_schema_check_names_what_is_wrong():
    assert validate({"events": []}) == ["top level must be an object with a traceEvents list"]
    bad = {"traceEvents": [{"name": "x", "ph": "X", "pid": 1, "tid": 1, "ts": "0", "dur": -1}]}
    assert validate(bad) == ["event 0: ts must be a number", "event 0: negative dur"]
    with pytest.raises(ValueError, match="not a valid trace"):
        from_chrome(bad)


# ------------------------------------------------------------------ nsys import
def nsys_fixture(path: Path) -> Path:
    """An export with nsys's documented layout; kernels and NVTX in nanoseconds."""
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL,
            deviceId INT NOT NULL, contextId INT NOT NULL, streamId INT NOT NULL,
            correlationId INT, globalPid INT, demangledName INT NOT NULL, shortName INT NOT NULL);
        CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL,
            rangeId INT, category INT, color INT, text TEXT, globalTid INT, endGlobalTid INT,
            textId INT REFERENCES StringIds(id), domainId INT);
        INSERT INTO StringIds VALUES (1, 'gemm'), (2, 'softmax'), (3, 'schedule');
        INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES
            (1000, 2000, 0, 1, 7, 1, 1, 1, 1), (1500, 3000, 0, 1, 8, 2, 1, 2, 2),
            (3500, 4000, 0, 1, 7, 3, 1, 1, 1), (10000, 12000, 0, 1, 7, 4, 1, 2, 2);
        INSERT INTO NVTX_EVENTS VALUES
            (4000, 9000, 59, NULL, 0, 0, NULL, 1, NULL, 3, 0),
            (9000, 9800, 59, NULL, 0, 0, 'launch', 1, NULL, NULL, 0),
            (9100, NULL, 34, NULL, 0, 0, 'a mark', 1, NULL, NULL, 0),
            (3000, 3400, 59, NULL, 0, 0, 'step 3', 1, NULL, NULL, 0);
    """)
    con.commit()
    con.close()
    return path


def test_nsys_import_finds_the_gaps_between_kernels_and_blames_nvtx_phases(tmp_path):
    trace = load_nsys(nsys_fixture(tmp_path / "run.sqlite"))
    assert sorted((p.name, p.start, p.end) for p in trace.phases) == [
        ("launch", 9e-6, 9.8e-6),
        ("schedule", 4e-6, 9e-6),
    ]
    report = analyze(trace)
    # Busy: 1000..3000 (two overlapping kernels), 3500..4000, 10000..12000.
    assert report.busy_s == pytest.approx(4500e-9)
    edges = [edge for g in report.gaps for edge in (g.start, g.end)]
    assert edges == pytest.approx([3e-6, 3.5e-6, 4e-6, 1e-5])
    assert [g.blame for g in report.gaps] == [UNTRACED, "schedule"]
    assert report.idle_fraction == pytest.approx(6500 / 11000)


def test_import_nsys_command_prints_the_report_and_refuses_other_files(tmp_path, capsys):
    from async_engine.cli.main import main

    assert main(["profile", "import-nsys", str(nsys_fixture(tmp_path / "run.sqlite"))]) == 0
    out = capsys.readouterr().out
    assert "idle gaps" in out and "schedule" in out
    (tmp_path / "junk.sqlite").write_text("not a database")
    assert main(["profile", "import-nsys", str(tmp_path / "junk.sqlite")]) == 2
    assert "not an SQLite file" in capsys.readouterr().err


# ------------------------------------------------------------------ the profile command
def profile_args(model: Path, out: Path, *more: str) -> list[str]:
    return [
        "profile",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--steps",
        "6",
        "--requests",
        "4",
        "--out",
        str(out),
        *more,
    ]


def test_profile_writes_trace_timeline_and_report(tiny_model, tmp_path, capsys):
    from async_engine.cli.main import main

    assert main(profile_args(tiny_model, tmp_path, "--overlap", "off")) == 0
    assert "device busy" in capsys.readouterr().out
    assert load_chrome(tmp_path / "trace.json").device
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "who the device waited on" in (tmp_path / "report.txt").read_text()


def test_profile_reports_what_speculation_did(tmp_path, capsys):
    from async_engine.cli.main import main

    argv = "profile --device sim --sim-step-ms 0.3 --sim-token-us 0 --sim-seq-us 0"
    argv += " --sim-ctx-ns 0 --sim-repeat 0.9 --steps 32 --requests 2 --out"
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}'
    assert main([*argv.split(), str(tmp_path), "--speculative-config", spec]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("speculation:"))
    assert "acceptance" in line and "mean accepted length" in line and "verify steps" in line
    assert line in (tmp_path / "report.txt").read_text()


def test_profile_without_speculation_says_nothing_of_it(tiny_model, tmp_path, capsys):
    from async_engine.cli.main import main

    assert main(profile_args(tiny_model, tmp_path)) == 0
    assert "speculation:" not in capsys.readouterr().out


def test_profile_compare_runs_both_modes_side_by_side(tiny_model, tmp_path, capsys):
    from async_engine.cli.main import main

    assert main(profile_args(tiny_model, tmp_path, "--compare")) == 0
    out = capsys.readouterr().out
    assert "overlap on" in out and "overlap off" in out and "steady-decode idle, on / off" in out
    for mode in ("on", "off"):
        assert {p.name for p in (tmp_path / mode).iterdir()} >= {
            "trace.json",
            "timeline.png",
            "report.txt",
        }
    assert (tmp_path / "compare.png").exists()


def test_profile_overhead_prints_the_tracer_cost(tiny_model, tmp_path, capsys):
    from async_engine.cli.main import main

    assert main(profile_args(tiny_model, tmp_path, "--overhead", "--rounds", "1")) == 0
    out = capsys.readouterr().out
    assert "throughput ratio on/off" in out and "estimated cost" in out


def test_profile_nsys_says_clearly_when_nsys_is_missing(tmp_path, monkeypatch, capsys):
    from async_engine.cli.main import main

    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["profile", "--nsys", "--out", str(tmp_path)]) == 2
    assert "nsys (NVIDIA Nsight Systems) is not on PATH" in capsys.readouterr().err


# ------------------------------------------------------------------ on-demand capture
def test_capture_records_the_next_steps_on_a_flag_file_and_on_sigusr2(tiny_model, tmp_path):
    from async_engine.core.llm import LLM
    from profiling.capture import FLAG_NAME, attach

    with LLM(model=str(tiny_model), dtype="float32", device="cpu") as llm:
        controller = attach(llm.engine, tmp_path, steps=5)
        controller.poll_s = 0.0
        try:
            (tmp_path / FLAG_NAME).write_text("4")
            llm.generate([[100] * 8] * 2, SamplingParams(max_tokens=12, ignore_eos=True))
            assert controller.finished.wait(30)
            os.kill(os.getpid(), signal.SIGUSR2)
            llm.generate([[101] * 8] * 2, SamplingParams(max_tokens=12, ignore_eos=True))
            assert controller.finished.wait(30)
        finally:
            controller.detach()
        assert llm.engine.observer is None
    assert not (tmp_path / FLAG_NAME).exists()
    first, second = controller.captures
    assert len(load_chrome(first / "trace.json").device) == 4
    assert len(load_chrome(second / "trace.json").device) == 5
    assert (second / "timeline.png").exists() and (second / "report.txt").exists()
