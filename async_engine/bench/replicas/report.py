"""The bench's tables: plain text, one row per phase (or per cancel path)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from async_engine.bench.load import percentiles
from async_engine.bench.replicas.affinity import Affinity
from async_engine.bench.replicas.cancel import CancelProbe


@dataclass(slots=True)
class PhaseResult:
    name: str
    summary: dict[str, Any]  # bench.load.summarize of the phase's requests
    tokens_per_event: float
    prompt_tokens: int  # sent
    max_cached: int  # the most a prefix cache could have served (workload.max_cached_tokens)
    cached_usage: int  # the servers' usage.prompt_tokens_details.cached_tokens, summed
    cached_metrics: float | None = None  # the replicas' vllm:prefix_cache_hits, summed
    requests_per_replica: list[float] | None = None  # from each replica's /metrics
    tapped_per_replica: list[int] | None = None  # as the taps counted them
    affinity: Affinity | None = None
    burst_repeats: int = 0  # opening-burst requests whose group the burst already had
    router_kv: dict[str, float] | None = None  # the router's KV lookups in the phase, by result


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def _share(part: float | None, whole: float) -> str:
    return "-" if part is None or whole <= 0 else f"{part / whole:.0%}"


def _split(values: list[float] | list[int] | None) -> str:
    return "-" if values is None else "/".join(f"{v:g}" for v in values)


def latency_table(phases: list[PhaseResult]) -> str:
    headers = ["phase", "req/s", "out tok/s", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95"]
    headers += ["tok/event", "errors"]
    rows = []
    for p in phases:
        s = p.summary
        rows.append(
            [
                p.name,
                f"{s['request_throughput']:.2f}",
                f"{s['output_tokens_per_s']:.0f}",
                _ms(s["ttft_s"]["p50"]),
                _ms(s["ttft_s"]["p95"]),
                _ms(s["itl_s"]["p50"]),
                _ms(s["itl_s"]["p95"]),
                f"{p.tokens_per_event:.2f}",
                str(s["errors"]),
            ]
        )
    return format_table(headers, rows) + "\n(latencies in ms)"


def placement_table(phases: list[PhaseResult]) -> str:
    headers = ["phase", "requests/replica (/metrics)", "(taps)", "affinity mean", "worst"]
    headers += ["cached/prompt", "cached/max", "(usage)"]
    rows = []
    for p in phases:
        a = p.affinity
        rows.append(
            [
                p.name,
                _split(p.requests_per_replica),
                _split(p.tapped_per_replica),
                "-" if a is None else f"{a.mean:.2f}",
                "-" if a is None else f"{a.worst:.2f}",
                _share(p.cached_metrics, p.prompt_tokens),
                _share(p.cached_metrics, p.max_cached),
                _share(p.cached_usage, p.max_cached),
            ]
        )
    note = (
        "affinity: share of a group's requests on its majority replica (1.00: all on one);"
        "\ncached/max: prompt tokens served from prefix caches over the most that could be"
        " (every request of a group after its first)"
    )
    return format_table(headers, rows) + "\n" + note


def router_kv_table(phases: list[PhaseResult]) -> str:
    """What a KV-event-fed router saw: per phase through it, its lookups by result."""
    headers = ["phase", "KV lookups", "hit", "miss", "no token ids", "other", "burst repeats"]
    rows = []
    for p in phases:
        if p.router_kv is None:
            continue
        kv = p.router_kv
        named = ("hit", "miss", "missing_tokens")
        other = sum(v for k, v in kv.items() if k not in named)
        counts = [sum(kv.values()), *(kv.get(k, 0.0) for k in named), other]
        rows.append([p.name, *(f"{c:g}" for c in counts), str(p.burst_repeats)])
    note = (
        "hit: the router found part of the prompt in a replica's KV events; no token ids: it"
        " had none for the prompt (a text or chat prompt needs the replica's /render);"
        "\nburst repeats: requests of the opening burst (the streams' first, sent together)"
        " whose group the burst already had: no replica can have announced their prefix yet"
    )
    return format_table(headers, rows) + "\n" + note


def cancel_table(paths: dict[str, list[CancelProbe]]) -> str:
    headers = ["path", "probes", "to replica p50", "max", "to release p50", "max", "seen by"]
    rows = []
    for name, found in paths.items():
        dropped = percentiles([p.dropped_s for p in found if p.dropped_s is not None])
        released = percentiles([p.released_s for p in found if p.released_s is not None])
        dropped_max = max((p.dropped_s for p in found if p.dropped_s is not None), default=None)
        released_max = max((p.released_s for p in found if p.released_s is not None), default=None)
        signals = sorted({p.signal for p in found})
        rows.append(
            [
                name,
                str(len(found)),
                _ms(dropped["p50"]),
                _ms(dropped_max),
                _ms(released["p50"]),
                _ms(released_max),
                ",".join(signals),
            ]
        )
    note = (
        "ms from the client closing its stream: to the replica's connection dropping (tap),"
        " and to the replica counting the abort (/metrics, polled every 5 ms)"
    )
    return format_table(headers, rows) + "\n" + note
