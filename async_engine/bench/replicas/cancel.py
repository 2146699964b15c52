"""Cancel-to-abort lag: a client drops a stream mid-way; how long until a replica let go.

One request at a time (nothing else in flight, so any change on a replica is its doing):
after a few streamed events the client closes its connection, then the replicas' /metrics
are polled until a replica's abort counter rises (``vllm:request_success_total`` with
reason abort, counted when the server ends the request) or, failing that, its running
count falls (a gauge refreshed every 0.25 s: coarser). The taps also note when the caller's
connection to the replica dropped: for a router, when it passed the cancellation on.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from async_engine.bench.replicas.client import GROUP_HEADER, completion_body, sse_events
from async_engine.bench.replicas.scrape import ReplicaCounters, scrape
from async_engine.bench.replicas.tap import Tap

EVENTS_BEFORE_CANCEL = 3
PROBE_OUTPUT_TOKENS = 4000  # far more than the time to cancel lets it make
POLL_S = 0.005
TIMEOUT_S = 5.0


@dataclass(slots=True, frozen=True)
class CancelProbe:
    dropped_s: float | None  # client close -> a tap saw the connection to its replica drop
    released_s: float | None  # client close -> a replica counted the abort (or stopped running)
    signal: str  # which replica metric showed it: "abort counter", "running gauge" or "none"


async def _counters(replica_urls: list[str]) -> list[ReplicaCounters]:
    return await asyncio.gather(*(asyncio.to_thread(scrape, u) for u in replica_urls))


def _released(before: list[ReplicaCounters], now: list[ReplicaCounters]) -> str | None:
    if any(n.aborted > b.aborted for b, n in zip(before, now, strict=True)):
        return "abort counter"
    if sum(n.running for n in now) < sum(b.running for b in before):
        return "running gauge"
    return None


async def probe(
    url: str, model: str, replica_urls: list[str], taps: list[Tap], request_id: str, seed: int
) -> CancelProbe:
    rng = random.Random(seed)
    tokens = [rng.randrange(100, 32000) for _ in range(64)]
    body = completion_body(model, tokens, PROBE_OUTPUT_TOKENS)
    headers = {GROUP_HEADER: "cancel", "x-request-id": request_id}
    events = sse_events(url, "/v1/completions", body, headers)
    seen = 0
    async for event in events:
        seen += any(c.get("text") for c in event.get("choices") or [])
        if seen == EVENTS_BEFORE_CANCEL:
            break
    # Counted while the probe runs (the gauge needs a refresh or two to show it running).
    await asyncio.sleep(0.3)
    before = await _counters(replica_urls)
    closed = time.perf_counter()
    await events.aclose()  # closes the socket: the cancellation
    signal, released = "none", None
    while time.perf_counter() - closed < TIMEOUT_S:
        fired = _released(before, await _counters(replica_urls))
        if fired is not None:
            signal, released = fired, time.perf_counter() - closed
            break
        await asyncio.sleep(POLL_S)
    drops = [t.dropped[request_id] for t in taps if request_id in t.dropped]
    dropped = min(drops) - closed if drops else None
    return CancelProbe(dropped, released, signal)


async def probes(
    url: str, model: str, replica_urls: list[str], taps: list[Tap], count: int, name: str
) -> list[CancelProbe]:
    out = []
    for i in range(count):
        out.append(await probe(url, model, replica_urls, taps, f"cancel-{name}-{i}", i))
        await asyncio.sleep(0.3)  # the replica's gauges settle before the next one
    return out
