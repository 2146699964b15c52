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
    def replay(self, plans: list[StepPlan]) -> float:
        """Run recorded plans back to back with no control plane; seconds taken (roofline)."""

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
