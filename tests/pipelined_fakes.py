"""A runner whose steps complete later, for the device loop's tests (imported by name in the
device process: its folder is put on PYTHONPATH)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from streams.plan import StepPlan, StepResult


@dataclass(slots=True)
class LatePending:
    step_id: int


class LateRunner:
    """finish(N) waits (up to a second) for step N+1 to be launched, then reports whether it
    was: a loop that reports N before launching N+1 shows up as token 0."""

    def __init__(self) -> None:
        self.info: dict = {}
        self.launched: list[int] = []
        self.changed = threading.Condition()

    def launch(self, plan: StepPlan, arrived_at: float | None = None) -> LatePending:
        with self.changed:
            self.launched.append(plan.step_id)
            self.changed.notify_all()
        return LatePending(plan.step_id)

    def finish(self, pending: LatePending) -> StepResult:
        with self.changed:
            self.changed.wait_for(lambda: pending.step_id + 1 in self.launched, timeout=1.0)
            overlapped = pending.step_id + 1 in self.launched
        return StepResult(pending.step_id, np.array([int(overlapped)], np.int64))

    def replay(self, plans: list[StepPlan]) -> StepResult:
        return StepResult(-1, [], device_start=1.0, device_end=2.0)


def build_late_runner() -> LateRunner:
    return LateRunner()


class LostRunner(LateRunner):
    """A GPU whose context died: finishing any step raises DeviceError."""

    def finish(self, pending: LatePending) -> StepResult:
        from streams.device import DeviceError

        raise DeviceError("the CUDA context is lost: an illegal memory access")


def build_lost_runner() -> LostRunner:
    return LostRunner()
