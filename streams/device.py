"""The Device contract: steps go in launch order, results come back through a file descriptor.

The control plane never blocks on a device: it calls ``launch`` (returns at once), watches
``completion_fd()`` with its event loop, and calls ``collect()`` when that is readable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streams.plan import StepPlan, StepResult

ModelFactory = Callable[[], Any]


REPLAY_STEP = -1


class DeviceError(RuntimeError):
    """The device failed as a whole (not one step): it died or cannot start."""


@dataclass(slots=True)
class DeviceSpec:
    """What a device needs to start: how to build the model, and the KV pool's shape."""

    model_factory: ModelFactory  # picklable: runs inside the device
    num_blocks: int
    block_size: int
    threads: int = 1
    fail_on_token_id: int | None = None


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


def create_device(kind: str, spec: DeviceSpec) -> Device:
    if kind == "cpu":
        from streams.cpu_device import ProcessDevice

        return ProcessDevice(spec)
    if kind == "cuda":
        from streams.cuda_device import CudaDevice

        return CudaDevice(spec)
    raise ValueError(f"device must be cpu or cuda, got {kind!r}")
