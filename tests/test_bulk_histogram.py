"""The bulk histogram exports what prometheus_client's Histogram would for the same values."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from async_engine.server.histograms import BulkHistogram

BUCKETS = (0.01, 0.025, 0.05, 0.1, 1.0)


@given(st.lists(st.floats(0, 5) | st.sampled_from(BUCKETS), max_size=50))
def test_exposition_equals_prometheus_clients_histogram(values: list[float]):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("itl", "gaps", ["model"], buckets=BUCKETS, registry=theirs)
    bulk = BulkHistogram("itl", "gaps", ["model"], BUCKETS, ours)
    series = reference.labels("m")  # both export the series from its creation on
    for value in values:
        series.observe(value)
    bulk.observe_many(("m",), values)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if "_created" not in line]

    assert lines(ours) == lines(theirs)
