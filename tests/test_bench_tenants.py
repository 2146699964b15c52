"""`bench serve --tenants`: the spec, the traces, and the service-difference report."""

from __future__ import annotations

import pytest

from async_engine.bench.load import Slo
from async_engine.bench.tenants import Sent, parse_tenants, report, schedule

NOISY = "a:burst=64,prompt=300,output=128;b:rate=1,duration=30,prompt=50,output=32"


def test_the_noisy_neighbour_spec_parses():
    a, b = parse_tenants(NOISY)
    assert (a.name, a.burst, a.prompt, a.output) == ("a", 64, (300, 300), (128, 128))
    assert (b.name, b.rate, b.duration, b.prompt) == ("b", 1.0, 30.0, (50, 50))


@pytest.mark.parametrize("spec", ["", "a", "a:rate=1", "a:burst=x", "a:colour=red", "a:burst"])
def test_a_bad_spec_is_refused(spec: str):
    with pytest.raises(ValueError, match="--tenants"):
        parse_tenants(spec)


def test_a_tenant_sends_the_same_requests_alone_and_beside_others():
    loads = parse_tenants(NOISY)
    shared = [(s.at_s, s.prompt, s.max_tokens) for s in schedule(loads, 1000, 0) if s.tenant == "b"]
    alone = [(s.at_s, s.prompt, s.max_tokens) for s in schedule(loads[1:], 1000, 0)]
    assert shared == alone and len(alone) > 10


def test_the_report_measures_service_difference_among_backlogged_tenants_only():
    sent = [Sent("a", 0.0, [1] * 10, 4), Sent("b", 0.0, [1] * 10, 4)]
    for s in sent:
        s.record.sent, s.record.first_token, s.record.end, s.record.tokens = 0.0, 0.1, 0.5, 4
    samples = [
        {"t": 0.25, "service": {"a": 10.0, "b": 4.0}, "backlogged": ["a", "b"]},
        {"t": 0.50, "service": {"a": 30.0, "b": 14.0}, "backlogged": ["a", "b"]},
        {"t": 0.75, "service": {"a": 90.0, "b": 14.0}, "backlogged": ["a"]},  # b not waiting
    ]
    run = {"duration_s": 1.0, "start": 0.0, "samples": samples, "service": {"a": 18.0, "b": 18.0}}
    out = report(sent, run, {"a": 2.0, "b": 1.0}, Slo(1.0, 1.0))
    assert out["service_diff"] == {"max": 16.0, "mean": 11.0, "samples": 2}
    assert out["weighted_service_ratio"] == pytest.approx((20 * 2) / (10 * 1))
    assert out["tenants"]["a"]["goodput"] == 1.0
