"""The Device contract: steps go in launch order, results come back through a file descriptor.

The control plane never blocks on a device: it calls ``launch`` (returns at once), watches
``completion_fd()`` with its event loop, and calls ``collect()`` when that is readable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from streams.plan import StepPlan, StepResult

REPLAY_STEP = -1


class DeviceError(RuntimeError):
    """The device failed as a whole (not one step): it died or cannot start."""


class Runner(Protocol):
    """What runs inside a device process: every runner (model on CPU or CUDA, simulated).

    ``launch`` enqueues a step and returns its pending handle without waiting for the
    device (a CPU runs the step inside it: its work is the host's); ``finish`` waits for a
    launched step and returns its result. The device loop launches from one thread and
    finishes from another, in launch order; a runner bounds how many are in flight by
    blocking in ``launch``.
    """

    info: dict[str, Any]  # told to the control plane at start (a GPU's KV pool size)

    def launch(self, plan: StepPlan, arrived_at: float) -> Any:
        """Enqueue ``plan`` (its bytes came in at ``arrived_at``); its pending step."""
        ...

    def finish(self, pending: Any) -> StepResult:
        """Wait for a launched step; its result (a failed step's carries its error)."""
        ...

    def replay(self, plans: list[StepPlan]) -> StepResult:
        """Run recorded plans back to back on fresh row state; one result spanning all."""
        ...


@dataclass(slots=True)
class DeviceSpec:
    """What a device needs to start: how to build its runner, inside the device."""

    runner_factory: Callable[[], Any]  # picklable (module-level function or partial)
    threads: int = 1  # torch threads of a CPU device


class Device(ABC):
    @abstractmethod
    def launch(self, plan: StepPlan) -> None:
        """Enqueue a step; returns before it runs."""

    @abstractmethod
    def completion_fd(self) -> int:
        """A descriptor that becomes readable when ``collect`` has results."""

    @abstractmethod
    def collect(self) -> list[StepResult]:
        """Results of finished steps, in launch order; never blocks for a running step."""

    @abstractmethod
    def launch_replay(self, plans: list[StepPlan]) -> None:
        """Enqueue recorded plans to run back to back with no control plane (the roofline).

        Completes like a step: ``collect`` returns one StepResult with step_id REPLAY_STEP
        whose device span covers the whole replay.
        """

    @abstractmethod
    def alive(self) -> bool:
        """False once the device can no longer run steps (its process died, say)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the device; safe to call twice."""

    def heartbeat_age(self) -> float:
        """Seconds since the device last showed it is responsive (0: it has no heartbeat)."""
        return 0.0

    def kill(self) -> None:
        """Stop a device that may not answer (hung, stopped); by default, ``close``."""
        self.close()
