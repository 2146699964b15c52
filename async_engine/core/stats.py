"""Engine statistics: load for balancers, and how long the device waited on the control plane."""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from streams.plan import StepResult

if TYPE_CHECKING:
    from async_engine.core.engine import AsyncEngine


class DeviceTimeline:
    """Rolling record of device spans, to compute the device idle fraction.

    A gap between two steps counts as idle only while the engine had work: the time a
    device spends with no request at all is not the control plane's fault.
    """

    def __init__(self, window: int = 256) -> None:
        self.spans: deque[tuple[int, float, float, bool]] = deque(maxlen=window)
        self._after_idle = True
        self._pending_after_idle: dict[int, bool] = {}
        self.steps = 0
        # Lifetime totals, for counters a scraper can difference over any interval.
        self.busy_seconds = 0.0
        self.idle_seconds = 0.0

    def mark_idle_engine(self) -> None:
        self._after_idle = True

    def forget_inflight(self) -> None:
        """Launched steps that will never complete (their device was lost)."""
        self._pending_after_idle.clear()
        self._after_idle = True

    def on_launch(self, step_id: int, when: float) -> None:
        self._pending_after_idle[step_id] = self._after_idle
        self._after_idle = False

    def on_result(self, result: StepResult) -> None:
        after_idle = self._pending_after_idle.pop(result.step_id, True)
        if self.spans and not after_idle:
            self.idle_seconds += max(0.0, result.device_start - self.spans[-1][2])
        self.busy_seconds += result.device_end - result.device_start
        self.spans.append((result.step_id, result.device_start, result.device_end, after_idle))
        self.steps += 1

    def idle_fraction(self, only: Container[int] | None = None) -> float:
        """Idle share of the device over the recorded window (0 when nothing ran).

        ``only``: count just the steps in it that follow another step in it (e.g. the
        decode-only steps, for "steady decode").
        """
        busy = idle = 0.0
        prev: tuple[int, float, float, bool] | None = None
        for span in self.spans:
            step, start, end, after_idle = span
            if only is None or (step in only and prev is not None and prev[0] in only):
                busy += end - start
                if prev is not None and not after_idle:
                    idle += max(0.0, start - prev[2])
            prev = span
        total = busy + idle
        return idle / total if total > 0 else 0.0


class PhaseClock:
    """Control-plane time per phase (schedule, launch, wait, apply, stream), lifetime totals.

    Plain float additions on the hot path; "wait" is time blocked on the device, the rest is
    the CPU work the overlap loop tries to hide behind the device.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + 1

    def mean_ms(self) -> dict[str, float]:
        return {k: 1000 * v / self.counts[k] for k, v in self.seconds.items()}


@dataclass(slots=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_usage: float
    device_idle_fraction: float  # over the recent window of steps
    device_busy_seconds: float  # lifetime
    device_idle_seconds: float  # lifetime: waiting for a plan while requests had work
    steps: int
    num_preemptions: int
    wasted_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    phase_seconds: dict[str, float]  # control-plane time per phase, lifetime totals
    phase_mean_ms: dict[str, float]  # per occurrence (about once per step)
    device_state: str  # serving | restarting | failed
    device_restarts: int  # devices replaced after a loss, lifetime
    planning_mode: str  # overlap | after-step | sync: how the last step was planned

    @classmethod
    def collect(cls, engine: AsyncEngine) -> EngineStats:
        pool, sched = engine.pool, engine.scheduler
        return cls(
            running=sched.num_running,
            waiting=sched.num_waiting,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used,
            kv_blocks_free=pool.num_free,
            kv_usage=pool.num_used / pool.num_blocks,
            device_idle_fraction=engine.timeline.idle_fraction(),
            device_busy_seconds=engine.timeline.busy_seconds,
            device_idle_seconds=engine.timeline.idle_seconds,
            steps=engine.timeline.steps,
            num_preemptions=sched.num_preemptions,
            wasted_tokens=sched.wasted_tokens,
            prefix_cache_queries=pool.prefix_queries,
            prefix_cache_hits=pool.prefix_hits,
            phase_seconds=dict(engine.phase_clock.seconds),
            phase_mean_ms=engine.phase_clock.mean_ms(),
            device_state=engine.device_state.value,
            device_restarts=engine.supervisor.restarts,
            planning_mode=engine.planning_mode,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
