"""Fault injection for tests: a Device wrapper that fails every step holding a poison token."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from streams.device import Device
from streams.plan import StepPlan, StepResult


class FailingDevice(Device):
    """Forwards every call; a step whose input holds ``poison`` comes back as a failed step.

    The step still runs on the real device, so launch order, completion and KV state stay
    exactly as the engine expects; only the result the engine sees is turned into an error.
    """

    def __init__(self, device: Device, poison: int) -> None:
        self.device = device
        self.poison = poison
        self._doomed: set[int] = set()

    def launch(self, plan: StepPlan) -> None:
        if self.poison in list(plan.input_ids):
            self._doomed.add(plan.step_id)
        self.device.launch(plan)

    def completion_fd(self) -> int:
        return self.device.completion_fd()

    def collect(self) -> list[StepResult]:
        return [self._fail(result) for result in self.device.collect()]

    def _fail(self, result: StepResult) -> StepResult:
        if result.step_id not in self._doomed:
            return result
        self._doomed.discard(result.step_id)
        return dataclasses.replace(
            result,
            tokens=[],
            logprobs=None,
            top_logprobs=None,
            error=f"injected failure on token {self.poison}",
        )

    def launch_replay(self, plans: list[StepPlan]) -> None:
        self.device.launch_replay(plans)

    def alive(self) -> bool:
        return self.device.alive()

    def close(self) -> None:
        self.device.close()

    def heartbeat_age(self) -> float:
        return self.device.heartbeat_age()

    def kill(self) -> None:
        self.device.kill()

    @property
    def pid(self) -> int:
        return self.device.pid  # type: ignore[attr-defined]


def fail_on(token: int) -> Callable[[Device], Device]:
    """A ``device_wrapper`` for AsyncEngine or LLM: steps whose input holds ``token`` fail."""
    return lambda device: FailingDevice(device, token)


class WithholdingDevice(FailingDevice):
    """From the first step whose input holds ``poison`` on, no result ever comes back: a
    device that hangs mid-step while its process (and heartbeat) stay alive."""

    def __init__(self, device: Device, poison: int) -> None:
        super().__init__(device, poison)
        self._hung_from: int | None = None

    def launch(self, plan: StepPlan) -> None:
        if self._hung_from is None and self.poison in list(plan.input_ids):
            self._hung_from = plan.step_id
        self.device.launch(plan)

    def collect(self) -> list[StepResult]:
        results = self.device.collect()
        if self._hung_from is None:
            return results
        return [r for r in results if r.step_id < self._hung_from]


def withhold_after(token: int) -> Callable[[Device], Device]:
    """A ``device_wrapper``: results stop at the first step whose input holds ``token``."""
    return lambda device: WithholdingDevice(device, token)
