"""Where the time went: the device's busy and idle spans, and the control plane's phases."""

from __future__ import annotations

from collections import deque
from collections.abc import Container

from streams.plan import StepResult


class DeviceTimeline:
    """Rolling record of device spans, to compute the device idle fraction.

    A gap between two steps counts as idle only while the engine had work: the time a
    device spends with no request at all is not the control plane's fault.
    """

    def __init__(self, window: int = 256) -> None:
        self.reset(window)

    def reset(self, window: int = 256) -> None:
        """Forget every span and total; keep up to ``window`` spans from now on."""
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
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + 1

    def mean_ms(self) -> dict[str, float]:
        return {k: 1000 * v / self.counts[k] for k, v in self.seconds.items()}
