"""Streams, events, pinned memory and graph capture: torch.cuda on a GPU, a host twin on CPU.

A CPU-only torch cannot record events, pin memory or capture graphs (``torch.Event('cpu')
.record()`` raises, ``pin_memory=True`` raises), so the pipelined runner talks to this small
interface instead. On the host every stream runs in program order, so a wait is a check that
the event was recorded (waiting on an unrecorded event is a bug the GPU would hang or race on,
so the twin raises), and an event is a ``perf_counter`` stamp. The same runner code then runs
on CPU tensors, serialised: tests see its logic, only a GPU shows its concurrency.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch


class HostEvent:
    """An event on a host stream: recording stamps the time; it is complete once recorded."""

    __slots__ = ("stamp",)

    def __init__(self) -> None:
        self.stamp: float | None = None

    def record(self, stream: Any = None) -> None:
        self.stamp = time.perf_counter()

    def query(self) -> bool:
        return self.stamp is not None

    def synchronize(self) -> None:
        if self.stamp is None:
            raise RuntimeError("waited on an event that was never recorded")

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``, like ``torch.cuda.Event.elapsed_time``."""
        self.synchronize()
        end.synchronize()
        return (end.stamp - self.stamp) * 1e3  # type: ignore[operator]


class HostStream:
    """Work on the host runs when issued, so waits only check their event was recorded."""

    def wait_event(self, event: HostEvent) -> None:
        event.synchronize()

    def wait_stream(self, stream: HostStream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class DeviceSync:
    """Base: the host twin. ``CudaSync`` overrides each part with its torch.cuda twin."""

    graph_capable = False  # whether CUDA graphs can be captured and replayed
    # Whether work is done when issued (the host twin): a launched step's tokens are then on
    # the host at once, and waiting for them costs nothing.
    serial = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self) -> Any:
        return HostStream()

    def event(self, timing: bool = False, blocking: bool = False) -> Any:
        return HostEvent()

    def use(self, stream: Any) -> Any:
        """Context manager: work issued inside runs on ``stream``."""
        return nullcontext()

    def pinned(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device can copy from without staging (page-locked on CUDA)."""
        return torch.zeros(size, dtype=dtype)

    def synchronize(self) -> None:
        pass

    @contextmanager
    def step_range(self, name: str) -> Iterator[None]:
        """An NVTX range around a step's launch, for nsys (nothing on the host)."""
        yield


class CudaSync(DeviceSync):
    graph_capable = True
    serial = False

    def stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def event(self, timing: bool = False, blocking: bool = False) -> Any:
        # A blocking event lets synchronize() sleep instead of spinning a core.
        return torch.cuda.Event(enable_timing=timing, blocking=blocking)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def pinned(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    @contextmanager
    def step_range(self, name: str) -> Iterator[None]:
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()


def for_device(device: torch.device | str) -> DeviceSync:
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return CudaSync(device)
    return DeviceSync(device)
