"""A waiting queue: requests in (priority, arrival) order, or in arrival order alone.

Queue operations only. Which queue's head is admitted next, when, and who is preempted is
the scheduling policy's call (``async_engine/core/policy``): ``fcfs`` and ``priority``
keep one queue, ``fair`` one per tenant.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from async_engine.core.request import Request


class WaitQueue:
    __slots__ = ("_by_priority", "_heap", "_pushes")

    def __init__(self, by_priority: bool = True) -> None:
        self._by_priority = by_priority
        # (priority or 0, arrival_seq, push count, request): the count breaks ties between
        # requests of the same arrival number, so two requests are never compared.
        self._heap: list[tuple[int, int, int, Request]] = []
        self._pushes = itertools.count()

    def push(self, req: Request) -> None:
        priority = req.priority if self._by_priority else 0
        heapq.heappush(self._heap, (priority, req.arrival_seq, next(self._pushes), req))

    def peek(self) -> Request | None:
        """The head: the request ``pop`` takes next; None if empty."""
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        """Take the head off the queue."""
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> bool:
        """Take ``req`` off the queue wherever it stands; False if it was not queued."""
        before = len(self._heap)
        self._heap = [e for e in self._heap if e[3] is not req]
        if len(self._heap) == before:
            return False
        heapq.heapify(self._heap)
        return True

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Every queued request, in no particular order."""
        return (e[3] for e in self._heap)
