"""A histogram for per-token observations, exported like prometheus_client's own.

prometheus_client's ``Histogram.observe`` takes a lock and walks the buckets for every
value: about 2 us, which for inter-token latency (one value per generated token, twice
with the per-tenant series) was a tenth of the server's CPU under load. This one takes a
request's gaps at once: one bisect per value and plain additions, no lock (every caller
is on the event loop). The exposition is the same: ``_bucket{le=...}``, ``_count``, ``_sum``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector


class _Series:
    __slots__ = ("counts", "total")

    def __init__(self, size: int) -> None:
        self.counts = [0] * size
        self.total = 0.0


class BulkHistogram(Collector):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = [float(b) for b in buckets if b != float("inf")]
        self._series: dict[tuple[str, ...], _Series] = {}
        registry.register(self)

    def observe_many(self, labels: tuple[str, ...], values: Iterable[float]) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _Series(len(self.bounds) + 1)
        counts, bounds, where = series.counts, self.bounds, bisect.bisect_left
        total = 0.0
        for value in values:
            counts[where(bounds, value)] += 1  # le: a value equal to a bound counts in it
            total += value
        series.total += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, series in self._series.items():
            running, buckets = 0, []
            for bound, count in zip([*self.bounds, float("inf")], series.counts, strict=True):
                running += count
                buckets.append((_le(bound), running))
            family.add_metric(list(labels), buckets, series.total)
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
