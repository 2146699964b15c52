"""How long the device takes for a step, learnt from the steps it ran.

A step's time depends mostly on how many tokens it computes (a 512-token prefill chunk
runs three times as long as a 64-row decode on a CPU), so each power-of-two size class
keeps a moving average of its steps' tokens and seconds, and a step of another size is
interpolated between the nearest classes it has seen.
"""

from __future__ import annotations

import bisect
from operator import itemgetter


class StepTimes:
    ALPHA = 0.2  # weight of the newest step in its class's average

    def __init__(self) -> None:
        self._classes: dict[int, list[float]] = {}  # size class -> [mean tokens, mean s]
        self._points: list[list[float]] = []  # the same, by size (a class keeps its range)

    def observe(self, tokens: int, seconds: float) -> None:
        point = self._classes.get(tokens.bit_length())
        if point is None:
            self._classes[tokens.bit_length()] = [float(tokens), seconds]
            self._points = [self._classes[k] for k in sorted(self._classes)]
            return
        point[0] += self.ALPHA * (tokens - point[0])
        point[1] += self.ALPHA * (seconds - point[1])

    def sizes(self) -> list[float]:
        """The mean token counts of the size classes seen, smallest first."""
        return [point[0] for point in self._points]

    def predict(self, tokens: int) -> float | None:
        """Expected seconds of a step of ``tokens``; None before any step was seen."""
        points = self._points
        if not points:
            return None
        i = bisect.bisect_left(points, tokens, key=itemgetter(0))
        if i == 0 or i == len(points):
            # Outside the sizes seen: in proportion to the nearest. Too short a guess only
            # plans the next step early, as for GPU-speed steps; never later than it should.
            x, y = points[0] if i == 0 else points[-1]
            return y * tokens / x
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
