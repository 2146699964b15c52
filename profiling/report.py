"""From a trace to figures: device busy/idle, idle gaps and who the device waited on, phase CPU.

Definitions (the same as ``async_engine.core.stats.DeviceTimeline``, so the numbers agree):
- busy: the union of device spans; window: first device start to last device end.
- idle gap: time between two device spans while the engine had work. A gap before a step
  launched after the engine ran out of requests (``after_idle``) is engine idle, not device
  idle, and is left out of both figures.
- idle fraction = idle / (busy + idle).
- steady decode: pairs of consecutive steps that both only decode (every query_len == 1);
  their gaps and the busy time of the second step of each pair.
- blame of a gap: "device-side" when the next step's launch had already ended before the gap
  began (the device had its next plan and did not wait on the control plane: result send,
  plan receive, IPC inside the device). Otherwise the control-plane phase that overlapped the
  gap longest, or "untraced" when no phase covered most of it (event-loop wake-up, IPC, GIL,
  or work outside the traced phases).
- hidden CPU: the part of a phase that ran while the device was busy, so cost no device time.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import accumulate, pairwise

from profiling.trace import DeviceSpan, PhaseSpan, Trace

UNTRACED = "untraced"
DEVICE_SIDE = "device-side"
BLOCKING_PHASES = ("wait",)  # the control plane is blocked, not computing


@dataclass(slots=True)
class Gap:
    start: float
    end: float
    prev_step: int
    next_step: int
    decode: bool  # between two steady-decode steps
    blame: str
    overlaps: dict[str, float]  # seconds of the gap each phase (and UNTRACED) covered

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class PhaseStat:
    name: str
    count: int  # spans
    steps: int  # distinct steps the phase worked on
    total_s: float
    per_step_ms: tuple[float, float, float]  # mean, p50, p95 over steps
    hidden_s: float  # overlapping device busy time

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_s / self.total_s if self.total_s > 0 else float("nan")


@dataclass(slots=True)
class Report:
    source: str
    steps: int
    window_s: float
    busy_s: float
    idle_s: float
    engine_idle_s: float  # gaps with no request in the engine, excluded from idle
    decode_pairs: int
    decode_busy_s: float
    decode_idle_s: float
    tokens: int
    prefill_tokens: int
    decode_tokens: int
    mean_batch: float
    gaps: list[Gap] = field(default_factory=list)
    phases: list[PhaseStat] = field(default_factory=list)

    @property
    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else float("nan")

    @property
    def busy_fraction(self) -> float:
        return 1.0 - self.idle_fraction

    @property
    def decode_idle_fraction(self) -> float:
        total = self.decode_busy_s + self.decode_idle_s
        return self.decode_idle_s / total if total > 0 else float("nan")

    def gap_stats(self, decode_only: bool = False) -> tuple[int, float, float, float]:
        """count, p50, p95, max of gap lengths in seconds (nan when there are none)."""
        values = [g.seconds for g in self.gaps if g.decode or not decode_only]
        return len(values), percentile(values, 50), percentile(values, 95), max(values, default=0)

    def blame_seconds(self) -> dict[str, float]:
        """Total gap time covered by each phase (and UNTRACED), largest first."""
        totals: dict[str, float] = defaultdict(float)
        for gap in self.gaps:
            for name, seconds in gap.overlaps.items():
                totals[name] += seconds
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def blame_counts(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for gap in self.gaps:
            counts[gap.blame] += 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def analyze(trace: Trace) -> Report:
    trace = trace.sorted()
    device = trace.device
    runs = _merge_device(device)
    busy = [(s, e) for s, e, _, _ in runs]
    report = Report(
        source=trace.source,
        steps=len(device),
        window_s=(runs[-1][1] - runs[0][0]) if runs else 0.0,
        busy_s=sum(e - s for s, e in busy),
        idle_s=0.0,
        engine_idle_s=0.0,
        decode_pairs=0,
        decode_busy_s=0.0,
        decode_idle_s=0.0,
        tokens=sum(d.tokens for d in device),
        prefill_tokens=sum(d.prefill_tokens for d in device),
        decode_tokens=sum(d.decode_tokens for d in device),
        mean_batch=sum(d.batch for d in device) / len(device) if device else 0.0,
    )
    cover = _Cover(trace.phases)
    launched = {p.step: p.end for p in trace.phases if p.name == "launch" and p.step >= 0}
    for (_, prev_end, _, prev_last), (start, end, next_first, _) in pairwise(runs):
        prev, nxt = device[prev_last], device[next_first]
        decode = prev.is_decode and nxt.is_decode
        if decode:
            report.decode_pairs += 1
            report.decode_busy_s += end - start
        if nxt.after_idle:
            report.engine_idle_s += start - prev_end
            continue
        report.idle_s += start - prev_end
        if decode:
            report.decode_idle_s += start - prev_end
        if launched.get(nxt.step, start) < prev_end:
            overlaps = {DEVICE_SIDE: start - prev_end}
        else:
            overlaps = cover.overlaps(prev_end, start)
        blame = max(overlaps, key=overlaps.__getitem__) if overlaps else UNTRACED
        report.gaps.append(Gap(prev_end, start, prev.step, nxt.step, decode, blame, overlaps))
    report.phases = _phase_stats(trace.phases, busy)
    return report


def _merge_device(device: list[DeviceSpan]) -> list[tuple[float, float, int, int]]:
    """Union of sorted device spans: (start, end, first index, last index) per busy run."""
    runs: list[list] = []
    for i, span in enumerate(device):
        if runs and span.start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], span.end)
            runs[-1][3] = i
        else:
            runs.append([span.start, span.end, i, i])
    return [tuple(r) for r in runs]


class _Cover:
    """Which spans overlap an interval, for sorted spans that may nest (nsys NVTX ranges)."""

    def __init__(self, spans: list[PhaseSpan]) -> None:
        self.spans = spans
        self.starts = [s.start for s in spans]
        # Running max of ends: every span before the first index whose max end passes t
        # ended by t, so the search can start there even when spans nest.
        self.max_ends = list(accumulate((s.end for s in spans), max))

    def overlaps(self, start: float, end: float) -> dict[str, float]:
        """Seconds of [start, end] covered by each phase name, plus UNTRACED for the rest."""
        if end <= start:
            return {}
        found: dict[str, float] = defaultdict(float)
        pieces = []
        i = bisect_right(self.max_ends, start)
        while i < len(self.spans) and self.starts[i] < end:
            span = self.spans[i]
            lo, hi = max(start, span.start), min(end, span.end)
            if hi > lo:
                found[span.name] += hi - lo
                pieces.append((lo, hi))
            i += 1
        untraced = (end - start) - _union_length(pieces)
        if untraced > 1e-12:
            found[UNTRACED] += untraced
        return dict(found)


def _union_length(pieces: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -math.inf
    for lo, hi in sorted(pieces):
        if hi <= reach:
            continue
        total += hi - max(lo, reach)
        reach = hi
    return total


def _phase_stats(phases: list[PhaseSpan], busy: list[tuple[float, float]]) -> list[PhaseStat]:
    busy_cover = _Cover([PhaseSpan("busy", -1, s, e) for s, e in busy])
    by_name: dict[str, list[PhaseSpan]] = defaultdict(list)
    for span in phases:
        by_name[span.name].append(span)
    stats = []
    for name, spans in by_name.items():
        per_step: dict[int, float] = defaultdict(float)
        hidden = 0.0
        for span in spans:
            per_step[span.step] += span.end - span.start
            hidden += busy_cover.overlaps(span.start, span.end).get("busy", 0.0)
        ms = [v * 1e3 for v in per_step.values()]
        stats.append(
            PhaseStat(
                name,
                len(spans),
                len(per_step),
                sum(s.end - s.start for s in spans),
                (sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 95)),
                hidden,
            )
        )
    order = {n: i for i, n in enumerate(("schedule", "launch", "wait", "apply", "stream"))}
    return sorted(stats, key=lambda s: (order.get(s.name, len(order)), s.name))
