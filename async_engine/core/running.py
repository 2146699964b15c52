"""The running requests, in the order the policy admitted them, with their rows as an array.

The scheduler plans decodes over the rows of this list all at once; the array is rebuilt
only when the list changes (a request admitted, ended or preempted), not every step.
"""

from __future__ import annotations

import numpy as np

from async_engine.core.request import Request


class Running(list):
    """A list of requests (what policies and preemption iterate), that keeps their rows and,
    in the same order, their output and token-time lists (a step appends to every one of
    them, at C speed only from a list at hand). Only ``append`` and ``remove`` change it."""

    __slots__ = ("_rows", "outputs", "times")

    def __init__(self) -> None:
        super().__init__()
        self._rows = np.zeros(0, np.int64)
        self.outputs: list[list[int]] = []
        self.times: list[list[float]] = []

    def append(self, req: Request) -> None:
        super().append(req)
        self._rows = np.append(self._rows, req.row)
        self.outputs.append(req.output_ids)
        self.times.append(req.token_times)

    def remove(self, req: Request) -> None:
        at = self.index(req)
        del self[at]
        del self.outputs[at]
        del self.times[at]
        self._rows = np.delete(self._rows, at)

    def rows(self) -> np.ndarray:
        """int64 [R]: each running request's device row, in running order."""
        return self._rows
