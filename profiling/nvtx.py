"""NVTX ranges and the cudaProfilerStart/Stop capture window, import-safe on CPU.

The engine reports a phase only once it has ended (``on_phase(name, step, start, end)``), and
NVTX cannot stamp a range with past timestamps. The control plane runs its phases back to back
in a fixed order (schedule -> launch -> wait -> apply -> stream -> schedule ...), so
``PhaseChain`` opens the *next* phase's range as soon as one phase is reported and closes it
when the next report arrives. In nsys the ranges line up with ours to within the few
microseconds between two phases. When the loop leaves that order (no plan to schedule, the
engine idle), the open range also covers the detour; code that can wrap a phase directly
should use ``nvtx_range`` instead, which is exact.

Device steps get their NVTX range from the device side (the CUDA runner pushes "step N" on
its stream thread); the control plane never sees a step start, so it cannot emit one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

NEXT_PHASE = {
    "schedule": "launch",
    "launch": "wait",
    "wait": "apply",
    "apply": "stream",
    "stream": "schedule",
}


def cuda_nvtx() -> Any | None:
    """torch.cuda.nvtx when a CUDA device is usable, else None (CPU builds, no GPU)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.nvtx


@contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An exact NVTX range around a block; a no-op without CUDA."""
    nvtx = cuda_nvtx()
    if nvtx is None:
        yield
        return
    nvtx.range_push(name)
    try:
        yield
    finally:
        nvtx.range_pop()


class PhaseChain:
    """Turns after-the-fact phase reports into NVTX start/end ranges (see module doc)."""

    __slots__ = ("_nvtx", "_open")

    def __init__(self, nvtx: Any) -> None:
        self._nvtx = nvtx
        self._open: Any = None

    def on_phase(self, name: str) -> None:
        # range_start/range_end (not push/pop): a range may end on another await boundary.
        if self._open is not None:
            self._nvtx.range_end(self._open)
        self._open = self._nvtx.range_start(NEXT_PHASE.get(name, "schedule"))

    def close(self) -> None:
        if self._open is not None:
            self._nvtx.range_end(self._open)
            self._open = None


def profiler_start() -> bool:
    """cudaProfilerStart, the opening of an ``nsys --capture-range=cudaProfilerApi`` window."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    torch.cuda.profiler.start()
    return True


def profiler_stop() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.profiler.stop()
