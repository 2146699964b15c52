"""How often a streaming reader is woken: as often as the device can afford.

Every wake-up of a reader (building its delta, detokenizing, a gRPC write) runs on the
event loop the engine's own loop runs on. At a GPU's 1-2 ms steps, 256 readers woken on
every step cost several milliseconds per step, and the device waits for the engine while
they run. So the pacer watches that interference directly: how long the engine, ready to
go on (its step's result had arrived), waited for the event loop to come back to it. When
that delay is a noticeable share of the step, readers are woken less often (each then
gets several tokens in one chunk); when it vanishes, they are woken every step again. On a
CPU device, where steps take tens of milliseconds, the interval stays at zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StreamPacer:
    interval_s: float = 0.0  # a reader is woken at most this often (0: on every step)
    max_interval_s: float = 0.1
    tolerance: float = 0.05  # share of a step the engine may be held up by readers
    # With this many streams or fewer every step wakes its readers: the hold-up is then
    # the loop's own wake-up jitter, which coalescing cannot remove (a lone stream got its
    # 64 tokens in 2 chunks at 1 ms steps).
    few_streams: int = 4

    def observe(self, held_up_s: float, step_s: float, streams: int) -> None:
        """One step's figures: how long readers held the engine up, the device step, and
        how many streams are read."""
        if streams <= self.few_streams:
            held_up_s = 0.0
        if held_up_s > self.tolerance * step_s:
            self.interval_s = min(self.max_interval_s, self.interval_s * 1.5 + 0.5e-3)
        elif self.interval_s > 0.0:
            self.interval_s *= 0.98
            if self.interval_s < 0.2e-3:
                self.interval_s = 0.0

    def due(self, last_wake: float, now: float) -> bool:
        return now - last_wake >= self.interval_s
