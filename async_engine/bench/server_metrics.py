"""The server's Prometheus counters that `bench serve` reads before and after each rate, and
the differences it reports: abort lag, device idle share, control-plane ms per step."""

from __future__ import annotations


def scrape(port: int | None) -> dict[str, float] | None:
    """The server's counters this bench differences: abort lag, device busy/idle time, steps
    and control-plane time per phase."""
    if port is None:
        return None
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {"lag_sum": 0.0, "lag_count": 0.0, "busy": 0.0, "idle": 0.0, "steps": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "async_engine:cancellation_lag_seconds_sum":
                out["lag_sum"] += sample.value
            elif sample.name == "async_engine:cancellation_lag_seconds_count":
                out["lag_count"] += sample.value
            elif sample.name == "async_engine:device_seconds_total":
                out[sample.labels["state"]] += sample.value
            elif sample.name == "async_engine:steps_total":
                out["steps"] += sample.value
            elif sample.name == "async_engine:step_phase_seconds_total":
                key = "phase:" + sample.labels["phase"]
                out[key] = out.get(key, 0.0) + sample.value
    return out


def lag_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """The mean cancellation lag over the run, and how many cancellations it averages."""
    if before is None or after is None or after["lag_count"] <= before["lag_count"]:
        return {"mean": float("nan"), "count": 0}
    count = after["lag_count"] - before["lag_count"]
    return {"mean": (after["lag_sum"] - before["lag_sum"]) / count, "count": count}


def idle_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> float:
    """The device's idle share over the run, measured by the server on the device's spans."""
    if before is None or after is None:
        return float("nan")
    busy, idle = after["busy"] - before["busy"], after["idle"] - before["idle"]
    return idle / (busy + idle) if busy + idle > 0 else float("nan")


def phase_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float]:
    """Server control-plane ms per step by phase over the run ("wait": on the device)."""
    if before is None or after is None or after["steps"] <= before["steps"]:
        return {}
    steps = after["steps"] - before["steps"]
    return {
        key[len("phase:") :]: 1e3 * (value - before.get(key, 0.0)) / steps
        for key, value in after.items()
        if key.startswith("phase:")
    }
