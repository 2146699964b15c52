"""Online-benchmark workload and statistics: Poisson or burst arrivals, latency percentiles,
goodput under SLOs. No I/O here; bench_serve drives the requests."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class LoadSpec:
    num_requests: int = 64
    min_prompt: int = 32
    max_prompt: int = 256
    min_output: int = 16
    max_output: int = 128
    cancel_fraction: float = 0.0  # share of requests the client abandons mid-stream
    burst: bool = False  # all requests at t=0 instead of Poisson arrivals
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.cancel_fraction <= 1:
            raise ValueError(f"cancel_fraction must be in [0, 1], got {self.cancel_fraction}")
        if self.min_prompt < 1 or self.min_prompt > self.max_prompt:
            raise ValueError("prompt lengths must satisfy 1 <= min_prompt <= max_prompt")
        if self.min_output < 1 or self.min_output > self.max_output:
            raise ValueError("output lengths must satisfy 1 <= min_output <= max_output")


@dataclass(slots=True, frozen=True)
class RequestSpec:
    at_s: float  # send time, from the start of the run
    prompt: list[int]
    max_tokens: int
    cancel_after: int | None  # abandon the stream after this many tokens


def make_requests(spec: LoadSpec, rate: float, vocab_size: int) -> list[RequestSpec]:
    """The same seed gives the same prompts and lengths at every rate (only spacing changes)."""
    rng = random.Random(spec.seed)
    arrivals = random.Random(spec.seed + 1)
    t = 0.0
    out = []
    for _ in range(spec.num_requests):
        prompt = [
            rng.randrange(100, vocab_size)
            for _ in range(rng.randint(spec.min_prompt, spec.max_prompt))
        ]
        max_tokens = rng.randint(spec.min_output, spec.max_output)
        cancel = None
        if rng.random() < spec.cancel_fraction and max_tokens > 1:
            cancel = rng.randint(1, max_tokens - 1)
        out.append(RequestSpec(t, prompt, max_tokens, cancel))
        if not spec.burst:
            t += arrivals.expovariate(rate)
    return out


@dataclass(slots=True)
class RequestRecord:
    sent: float = 0.0
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    cancelled: bool = False
    error: str | None = None
    abort_lag_s: float | None = None

    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    def tpot(self) -> float | None:
        if self.first_token is None or self.end is None or self.tokens < 2:
            return None
        return (self.end - self.first_token) / (self.tokens - 1)

    def itls(self) -> list[float]:
        # Like vLLM's benchmark: one gap per streamed message (a coalesced chunk counts once).
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_s: float = 1.0
    itl_s: float = 0.2  # judged on p95 by the capacity search
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        ttft, tpot, e2e = r.ttft(), r.tpot(), r.e2e()
        if ttft is None or ttft > self.ttft_s:
            return False
        if self.tpot_s is not None and tpot is not None and tpot > self.tpot_s:
            return False
        return not (self.e2e_s is not None and e2e is not None and e2e > self.e2e_s)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "mean": math.nan}
    s = sorted(values)

    def pick(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99), "mean": sum(s) / len(s)}


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo) -> dict[str, Any]:
    done = [r for r in records if r.end is not None and not r.cancelled and r.error is None]
    tokens = sum(r.tokens for r in records)
    lags = [r.abort_lag_s for r in records if r.abort_lag_s is not None]
    return {
        "requests": len(records),
        "completed": len(done),
        "cancelled": sum(r.cancelled for r in records),
        "errors": sum(r.error is not None for r in records),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_tokens_per_s": tokens / duration_s,
        "goodput": sum(slo.met_by(r) for r in done) / duration_s,
        "ttft_s": percentiles([t for r in done if (t := r.ttft()) is not None]),
        "tpot_s": percentiles([t for r in done if (t := r.tpot()) is not None]),
        "itl_s": percentiles([g for r in done for g in r.itls()]),
        "e2e_s": percentiles([t for r in done if (t := r.e2e()) is not None]),
        "abort_lag_s": percentiles(lags),
    }


def within_slo(summary: dict[str, Any], slo: Slo) -> bool:
    """The operating-limit test: p95 TTFT and p95 ITL within their targets, no errors."""
    ttft, itl = summary["ttft_s"]["p95"], summary["itl_s"]["p95"]
    return summary["errors"] == 0 and ttft <= slo.ttft_s and (math.isnan(itl) or itl <= slo.itl_s)
