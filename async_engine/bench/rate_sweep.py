"""The rates `bench serve` runs: each one asked for, then (--find-capacity) a search for the
highest rate that still meets the SLOs."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from async_engine.bench.load import Slo, within_slo

RunRate = Callable[[float], Awaitable[dict[str, Any]]]


async def sweep(
    run_rate: RunRate, rates: list[float], args: argparse.Namespace, slo: Slo
) -> dict[str, Any]:
    """Each rate asked for, then the capacity search if --find-capacity; summaries by rate."""
    results = {rate: await run_rate(rate) for rate in rates}
    capacity = None
    if args.find_capacity:
        capacity = await find_capacity(run_rate, results, args.max_rate, args.search_steps, slo)
    return {"runs": results, "capacity": capacity}


async def find_capacity(
    run_rate: RunRate, results: dict[float, Any], max_rate: float, steps: int, slo: Slo
) -> dict[str, Any] | None:
    """Double the rate until the SLO breaks, then bisect between the last good and first bad."""
    good = bad = None
    rate = min(results) if results else 1.0
    while rate <= max_rate:
        summary = results.get(rate) or await run_rate(rate)
        results[rate] = summary
        if not within_slo(summary, slo):
            bad = rate
            break
        good, rate = rate, rate * 2
    if good is None:
        return None
    for _ in range(steps if bad is not None else 0):
        mid = (good + bad) / 2
        results[mid] = summary = await run_rate(mid)
        good, bad = (mid, bad) if within_slo(summary, slo) else (good, mid)
    return {"rate": good, "at_limit": results[good], "first_failing_rate": bad}
