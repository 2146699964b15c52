"""StepTracer: the engine's StepObserver that keeps the last spans in a bounded ring buffer.

Cheap enough to leave on: each callback appends one tuple to a ``deque(maxlen=...)`` (O(1), no
growth, oldest spans fall off) and counts decode requests with ``list.count`` (C speed).
NamedTuples, sorting and all analysis happen in ``snapshot()``, off the hot path.

Inject it, the engine never imports profiling::

    tracer = StepTracer.attach(llm.engine)    # sets engine.observer
    llm.generate(...)
    trace = tracer.snapshot()
"""

from __future__ import annotations

from collections import deque
from typing import Any

from profiling.nvtx import PhaseChain, cuda_nvtx
from profiling.trace import DeviceSpan, PhaseSpan, Trace

DEFAULT_CAPACITY = 1 << 16  # spans kept per kind: ~13k steps of 5 phases, a few MB


class StepTracer:
    """Records phase and device spans (see module doc); implements ``StepObserver``."""

    __slots__ = ("_phases", "_device", "_engine", "_chain")

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, nvtx: bool | None = None, engine: Any = None
    ) -> None:
        """nvtx: None = emit NVTX ranges when CUDA is usable; engine: read its timeline to
        tell idle-engine gaps (no request at all) from gaps the device spent waiting."""
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._phases: deque[tuple[str, int, float, float]] = deque(maxlen=capacity)
        self._device: deque[tuple] = deque(maxlen=capacity)
        self._engine = engine
        module = cuda_nvtx() if nvtx is not False else None
        if nvtx and module is None:
            raise ValueError("nvtx=True needs torch with a usable CUDA device")
        self._chain = PhaseChain(module) if module is not None else None

    @classmethod
    def attach(cls, engine: Any, **options: Any) -> StepTracer:
        """A tracer installed as ``engine.observer``."""
        tracer = cls(engine=engine, **options)
        engine.observer = tracer
        return tracer

    # ------------------------------------------------------------ hot path
    def on_phase(self, name: str, step_id: int, start: float, end: float) -> None:
        self._phases.append((name, step_id, start, end))
        if self._chain is not None:
            self._chain.on_phase(name)

    def on_device(self, plan: Any, result: Any) -> None:
        query_lens = plan.query_lens
        decode = int((query_lens == 1).sum())
        tokens = plan.num_tokens
        self._device.append(
            (
                result.step_id,
                result.device_start,
                result.device_end,
                len(query_lens),
                tokens,
                tokens - decode,
                decode,
                self._after_idle(result.step_id),
            )
        )

    def _after_idle(self, step_id: int) -> bool:
        # The engine records the step in its timeline just before calling us.
        spans = self._engine.timeline.spans if self._engine is not None else None
        if spans:
            last = spans[-1]
            if last[0] == step_id:
                return last[3]
        return False

    # ----------------------------------------------------------- off the hot path
    def __len__(self) -> int:
        """Device steps currently held."""
        return len(self._device)

    def snapshot(self) -> Trace:
        """A sorted copy of what the ring buffer holds now."""
        phases = [PhaseSpan._make(p) for p in list(self._phases)]
        device = [DeviceSpan._make(d) for d in list(self._device)]
        return Trace(phases, device).sorted()

    def clear(self) -> None:
        self._phases.clear()
        self._device.clear()

    def close(self) -> None:
        """Close the open NVTX range; call when tracing stops."""
        if self._chain is not None:
            self._chain.close()
