"""Hooks the control plane calls so that a profiler can watch it without being imported by it.

The engine never imports ``profiling``; a tracer is injected with ``engine.observer = ...``.
Every timestamp is ``time.monotonic()``, the clock the device process stamps steps with.
"""

from __future__ import annotations

from typing import Protocol

from streams.plan import StepPlan, StepResult

# Control-plane phases, in loop order. "wait" is the control plane blocked on the device.
PHASES = ("schedule", "launch", "wait", "apply", "stream")


class StepObserver(Protocol):
    def on_phase(self, name: str, step_id: int, start: float, end: float) -> None:
        """A control-plane phase ended; step_id is the step it worked on (-1 if none)."""

    def on_device(self, plan: StepPlan, result: StepResult) -> None:
        """The device finished a step; result.device_start/end bound its device span."""
