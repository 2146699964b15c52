"""Device events placed on the host's ``time.monotonic`` clock.

A GPU step's start and end are events on the compute stream; the control plane's timeline and
the profiler's gap report speak host time. An anchor event, recorded and waited for while the
device is idle, pairs one device instant with one host instant (the midpoint of the host
stamps taken before recording it and after it completed: the wait's wake-up latency would
bias the later one); every later event is the anchor plus ``anchor.elapsed_time(event)``.

``elapsed_time`` is float32 milliseconds, so its resolution falls as the anchor ages (~8 us
after 100 s, ~62 us after 17 minutes), and under sustained overlap the device is never idle
to anchor again. So a completed step's end, once placed, becomes the anchor when the anchor
is over ``REANCHOR_S`` old: each placement then reads a float32 span of at most about a
second (~0.06 us), at the cost of that much error per second carried along the chain.
"""

from __future__ import annotations

import time
from typing import Any

from streams.pipeline.devsync import DeviceSync

REANCHOR_S = 1.0  # clocks drift by parts per million: a second between anchors is plenty


class EventClock:
    def __init__(self, sync: DeviceSync, now: Any = time.monotonic) -> None:
        self._sync = sync
        self._now = now
        self._anchor: tuple[Any, float] | None = None  # (event, host time): swapped as one

    def anchor(self, stream: Any = None) -> None:
        """Pair a fresh device instant with the host clock; call with nothing in flight."""
        event = self._sync.event(timing=True, blocking=True)
        before = self._now()
        event.record(stream)
        event.synchronize()
        self._anchor = (event, (before + self._now()) / 2)

    def anchor_due(self) -> bool:
        return self._anchor is None or self._now() - self._anchor[1] > REANCHOR_S

    def to_host(self, event: Any, advance: bool = False) -> float:
        """The host time at which ``event`` (recorded after the anchor, complete) happened.
        ``advance``: no event placed later precedes this one (a step's end), so it may
        become the anchor."""
        if self._anchor is None:
            raise RuntimeError("EventClock.to_host before anchor()")
        anchor, host = self._anchor
        at = host + anchor.elapsed_time(event) / 1e3
        if advance and at - host > REANCHOR_S:
            self._anchor = (event, at)
        return at
