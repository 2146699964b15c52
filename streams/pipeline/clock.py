"""Device events placed on the host's ``time.monotonic`` clock.

A GPU step's start and end are events on the compute stream; the control plane's timeline and
the profiler's gap report speak host time. An anchor event, recorded and waited for while the
device is idle, pairs one device instant with one host instant; every later event is the anchor
plus ``anchor.elapsed_time(event)``. Gaps between two events come from the events alone; only
their placement against host phases carries the anchor's error (the wait's wake-up latency).
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
        event.record(stream)
        event.synchronize()
        self._anchor = (event, self._now())

    def anchor_due(self) -> bool:
        return self._anchor is None or self._now() - self._anchor[1] > REANCHOR_S

    def to_host(self, event: Any) -> float:
        """The host time at which ``event`` (recorded after the anchor, complete) happened."""
        if self._anchor is None:
            raise RuntimeError("EventClock.to_host before anchor()")
        anchor, host = self._anchor
        return host + anchor.elapsed_time(event) / 1e3
