"""What a trace is: control-plane phase spans and device step spans, in seconds.

Everything that reads or writes traces (report, Chrome export, plot, nsys import) works on
this one shape, so a trace loaded from Chrome JSON or nsys SQLite reports like a live one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class PhaseSpan(NamedTuple):
    """A control-plane phase ("schedule", "launch", "wait", "apply", "stream")."""

    name: str
    step: int  # the step the phase worked on; -1 when unknown (e.g. from nsys)
    start: float
    end: float


class DeviceSpan(NamedTuple):
    """One step on the device. batch == 0 means unknown (a kernel interval from nsys)."""

    step: int
    start: float
    end: float
    batch: int = 0  # requests in the step
    tokens: int = 0  # tokens computed (prefill + decode)
    prefill_tokens: int = 0  # tokens of requests with query_len > 1
    decode_tokens: int = 0  # requests with query_len == 1 (one token each)
    after_idle: bool = False  # launched after the engine had no work: the gap before is not idle

    @property
    def is_decode(self) -> bool:
        """Steady decode: every request in the step computes exactly one token."""
        return self.batch > 0 and self.decode_tokens == self.batch


@dataclass(slots=True)
class Trace:
    phases: list[PhaseSpan] = field(default_factory=list)
    device: list[DeviceSpan] = field(default_factory=list)
    source: str = "tracer"  # "tracer" | "chrome" | "nsys": says what the spans are

    def sorted(self) -> Trace:
        return Trace(
            sorted(self.phases, key=lambda p: (p.start, p.end)),
            sorted(self.device, key=lambda d: (d.start, d.end)),
            self.source,
        )

    @property
    def origin(self) -> float:
        """Earliest timestamp, the zero of exported timelines."""
        first = min((s.start for s in [*self.phases, *self.device]), default=0.0)
        return first

    def steps(self, first: int, last: int) -> Trace:
        """The spans of steps first..last (inclusive); phases without a step are dropped."""
        return Trace(
            [p for p in self.phases if first <= p.step <= last],
            [d for d in self.device if first <= d.step <= last],
            self.source,
        )
