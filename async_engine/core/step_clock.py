"""The step clock: every timing question the engine's loop asks, from one set of measurements.

It records, per completed step, the device's time (by the step's token count, in
``StepTimes``) and the control plane's own work, and from those answers:

- how step N+1 is planned (``planning_delay``): at once while step N runs ("overlap"), or
  once step N has ended, waiting at most 1.25x its expected time ("after-step"), where the
  control plane's work is a sliver of a step (a CPU's ~1 ms beside tens of ms): a request
  arriving meanwhile then rides step N+1, a whole step sooner, for at most 2 % more device
  idle. Overlap off is "sync". ``mode`` names the choice (``stats().planning_mode``);
- how long to poll for a result instead of sleeping (``spin_budget``);
- when a step is hung (``hang_timeout``);
- whether the device is compute bound (``compute_bound``): whether a step's time grows
  with its tokens, as a CPU's does, rather than staying near a floor, as a GPU's does.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from async_engine.core.step_times import StepTimes

PLANNINGS = ("auto", "overlap", "after-step")


class StepClock:
    SPIN_BELOW_S = 5e-3  # device steps shorter than this are awaited by polling
    # "auto" plans after the step where the control plane's work is under this share of it.
    PLAN_AFTER_STEP_BELOW = 0.02
    LATE_FACTOR = 1.25  # after-step: plan anyway once a step runs this far past its estimate
    HANG_FACTOR = 20.0  # a step this many times its estimate is hung (above the floor)
    # Compute bound: the largest steps seen took this many times the smallest, which had at
    # most 1/16 of their tokens. A GPU's 512-token step costs ~1.4x its 1-token step, a
    # CPU's tens of times; the 1/16 keeps two near sizes from deciding.
    COMPUTE_BOUND_RATIO = 3.0
    MIN_SIZE_SPREAD = 16

    def __init__(self, overlap: bool, planning: str = "auto", hang_floor_s: float = 30.0) -> None:
        if planning not in PLANNINGS:
            raise ValueError(f"planning must be one of {', '.join(PLANNINGS)}, got {planning!r}")
        self.overlap = overlap
        self.planning = planning
        self.hang_floor_s = hang_floor_s
        self.step_times = StepTimes()
        self.recent_step_s = 0.0  # moving average of the device's step time, any size
        self.started_at = 0.0  # when the step in flight began (about; the control clock)
        self.mode = "overlap" if overlap else "sync"
        self.compute_bound = False  # see _is_compute_bound; updated after every step
        # Control-plane work of recent steps; its median ignores a one-off slow step (the
        # first detokenization, a garbage collection).
        self._control: deque[float] = deque(maxlen=16)
        self._control_now = 0.0  # this step's so far

    def control_work(self, seconds: float) -> None:
        """Time the control plane spent on this step (schedule, launch, apply, stream)."""
        self._control_now += seconds

    def launched(self, now: float, device_idle: bool) -> None:
        if device_idle:
            self.started_at = now  # an idle device starts it at once

    def step_done(self, tokens: int, device_s: float, resumed_at: float) -> None:
        """A step of ``tokens`` took ``device_s`` on the device; the loop resumed then."""
        self.recent_step_s += 0.1 * (device_s - self.recent_step_s)
        self.step_times.observe(tokens, device_s)
        self._control.append(self._control_now)
        self._control_now = 0.0
        self.started_at = resumed_at  # the next step, queued behind this one, starts now
        self.compute_bound = self._is_compute_bound()

    def expected(self, tokens: int) -> float | None:
        return self.step_times.predict(tokens)

    def control_share(self, tokens: int) -> float | None:
        """The control plane's work per step over the expected time of a ``tokens`` step."""
        expected = self.step_times.predict(tokens)
        if expected is None or not self._control or expected <= 0.0:
            return None
        return statistics.median(self._control) / expected

    def planning_delay(self, tokens: int) -> float | None:
        """Seconds to wait for the step in flight (of ``tokens``) before planning the next;
        None: plan now, overlapping it. Sets ``mode``."""
        if not self.overlap:
            self.mode = "sync"
            return None
        if self.planning == "overlap" or not self._plans_after_step(tokens):
            self.mode = "overlap"
            return None
        self.mode = "after-step"
        expected = self.step_times.predict(tokens) or 0.0
        return self.started_at + self.LATE_FACTOR * expected - time.monotonic()

    def _plans_after_step(self, tokens: int) -> bool:
        if self.planning == "after-step":
            return self.step_times.predict(tokens) is not None
        share = self.control_share(tokens)
        return share is not None and share <= self.PLAN_AFTER_STEP_BELOW

    def spin_budget(self) -> float:
        """Poll for results only where steps are short: a CPU step of 50 ms is waited for
        asleep, a GPU-speed one awake (see DeviceLink.result)."""
        if self.recent_step_s > self.SPIN_BELOW_S:
            return 0.0
        return 2.0 * self.recent_step_s + 1e-3

    def is_short_step(self, device_s: float) -> bool:
        return device_s < self.SPIN_BELOW_S

    def hang_timeout(self, tokens: int) -> float:
        """Past this a step is hung: the configured floor, or 20x what steps of its size
        took lately (a long prefill chunk may run far longer than a decode)."""
        expected = self.step_times.predict(tokens) or 0.0
        return max(self.hang_floor_s, self.HANG_FACTOR * expected)

    def _is_compute_bound(self) -> bool:
        """Whether a step's time grows with its tokens (every token costs, as on a CPU)."""
        sizes = self.step_times.sizes()
        if len(sizes) < 2 or sizes[-1] < self.MIN_SIZE_SPREAD * sizes[0]:
            return False
        small, large = self.step_times.predict(sizes[0]), self.step_times.predict(sizes[-1])
        return bool(small and large and large >= self.COMPUTE_BOUND_RATIO * small)
