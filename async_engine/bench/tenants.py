"""`async-engine bench serve --tenants SPEC`: several tenants, each with its own load, on
one server per scheduling policy; per-tenant latency and the service difference over time.

SPEC is ``name:key=value,...`` per tenant, ``;`` between tenants. Keys: ``burst`` (that many
requests at t=0), ``rate`` and ``duration`` (Poisson arrivals, req/s for seconds),
``prompt`` and ``output`` (tokens; ``lo-hi`` for a range), ``start`` (seconds after t=0).
Per tenant it prints TTFT and ITL p50/p95/p99 and goodput (requests per second within
``--slo-ttft-ms``/``--slo-itl-ms``). The noisy neighbour:
``a:burst=64,prompt=300,output=128;b:rate=1,duration=30,prompt=50,output=32``.

Service is what VTC counts: prompt tokens at price 1 and output tokens at price 2, over
the tenant's weight, as seen by the client (a request's prompt counts once its first
token arrived). A tenant is backlogged while the server's queue holds one of its
requests (``GetLoad``'s per-tenant waiting count). The difference is sampled every
0.25 s while two or more are backlogged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

from async_engine.bench.load import RequestRecord, Slo, percentiles
from async_engine.bench.tenant_tables import print_comparison, print_report

SAMPLE_S = 0.25


@dataclass(slots=True)
class TenantLoad:
    name: str
    burst: int = 0
    rate: float = 0.0
    duration: float = 0.0
    prompt: tuple[int, int] = (32, 256)
    output: tuple[int, int] = (16, 128)
    start: float = 0.0


def _range(value: str) -> tuple[int, int]:
    lo, _, hi = value.partition("-")
    return int(lo), int(hi or lo)


def parse_tenants(spec: str) -> list[TenantLoad]:
    loads = []
    for part in spec.split(";"):
        if not part.strip():
            continue
        name, colon, rest = part.strip().partition(":")
        if not colon or not name:
            raise ValueError(f"--tenants: expected name:key=value,... got {part!r}")
        load = TenantLoad(name)
        for item in rest.split(","):
            key, eq, value = item.strip().partition("=")
            try:
                if key in ("prompt", "output"):
                    setattr(load, key, _range(value))
                elif key == "burst":
                    load.burst = int(value)
                elif key in ("rate", "duration", "start"):
                    setattr(load, key, float(value))
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"--tenants: bad item {item!r} for tenant {name!r} (keys: "
                    "burst, rate, duration, prompt, output, start)"
                ) from None
            if not eq:
                raise ValueError(f"--tenants: bad item {item!r}")
        if not load.burst and not (load.rate > 0 and load.duration > 0):
            raise ValueError(f"--tenants: tenant {name!r} needs burst=N or rate=R,duration=S")
        loads.append(load)
    if not loads:
        raise ValueError("--tenants names no tenant")
    return loads


@dataclass(slots=True)
class Sent:
    tenant: str
    at_s: float
    prompt: list[int]
    max_tokens: int
    record: RequestRecord = field(default_factory=RequestRecord)


def schedule(loads: list[TenantLoad], vocab: int, seed: int) -> list[Sent]:
    """Each tenant's requests from its own seed: a tenant run alone sends the same ones."""
    out = []
    for load in loads:
        rng = random.Random(f"{seed}:{load.name}")
        times = [load.start] * load.burst
        t = load.start
        while load.rate > 0 and (t := t + rng.expovariate(load.rate)) < load.start + load.duration:
            times.append(t)
        for at in times:
            prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(*load.prompt))]
            out.append(Sent(load.name, at, prompt, rng.randint(*load.output)))
    return sorted(out, key=lambda s: s.at_s)


async def drive(client: Any, sent: list[Sent], weights: dict[str, float]) -> dict[str, Any]:
    """Send every request on time; sample weighted service per tenant as it arrives."""
    from async_engine.client import Chunk

    start = time.perf_counter()
    tenants = sorted({s.tenant for s in sent})

    async def one(s: Sent) -> None:
        await asyncio.sleep(max(0.0, start + s.at_s - time.perf_counter()))
        rec = s.record
        rec.sent = time.perf_counter()
        stream = client.generate(
            s.prompt, max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True, tenant=s.tenant
        )
        try:
            async with contextlib.aclosing(stream):
                async for event in stream:
                    if isinstance(event, Chunk) and event.token_ids:
                        now = time.perf_counter()
                        if rec.first_token is None:
                            rec.first_token = now
                        rec.chunk_times.append(now)
                        rec.tokens += len(event.token_ids)
            rec.end = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - a failed request is reported, not fatal
            rec.error = repr(exc)

    def service(name: str) -> float:
        prompt = sum(len(s.prompt) for s in sent if s.tenant == name and s.record.first_token)
        output = sum(s.record.tokens for s in sent if s.tenant == name)
        return (prompt + 2 * output) / weights.get(name, 1.0)

    samples: list[dict[str, Any]] = []
    tasks = [asyncio.create_task(one(s)) for s in sent]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(SAMPLE_S)
        waiting = (await client.load()).tenants
        samples.append(
            {
                "t": time.perf_counter() - start,
                "service": {n: service(n) for n in tenants},
                "backlogged": [n for n in tenants if waiting.get(n, (0, 0))[0]],
            }
        )
    await asyncio.gather(*tasks)
    return {
        "duration_s": time.perf_counter() - start,
        "start": start,
        "samples": samples,
        "service": {n: service(n) for n in tenants},
    }


def report(
    sent: list[Sent], run: dict[str, Any], weights: dict[str, float], slo: Slo
) -> dict[str, Any]:
    tenants = sorted({s.tenant for s in sent})
    out: dict[str, Any] = {"duration_s": run["duration_s"], "tenants": {}}
    total = 0
    for name in tenants:
        recs = [s.record for s in sent if s.tenant == name]
        done = [r for r in recs if r.end is not None and r.error is None]
        total += sum(r.tokens for r in recs)
        out["tenants"][name] = {
            "requests": len(recs),
            "completed": len(done),
            "errors": sum(r.error is not None for r in recs),
            "ttft_s": percentiles([t for r in done if (t := r.ttft()) is not None]),
            "itl_s": percentiles([g for r in done for g in r.itls()]),
            "goodput": sum(slo.met_by(r) for r in done) / run["duration_s"],
            "last_done_s": max((r.end for r in done), default=run["start"]) - run["start"],
            "service": run["service"][name],
        }
    out["output_tokens_per_s"] = total / run["duration_s"]
    diffs, ratios = [], []
    for sample in run["samples"]:
        busy = sample["backlogged"]
        if len(busy) >= 2:
            values = [sample["service"][n] for n in busy]
            diffs.append(max(values) - min(values))
    out["service_diff"] = {
        "max": max(diffs, default=0.0),
        "mean": sum(diffs) / len(diffs) if diffs else 0.0,
        "samples": len(diffs),
    }
    # Raw service (not divided by weight) received while both of the first two tenants
    # were backlogged: VTC makes its ratio the weights' ratio.
    if len(tenants) >= 2:
        a, b = tenants[:2]
        both = [s for s in run["samples"] if a in s["backlogged"] and b in s["backlogged"]]
        if len(both) >= 2:
            first, last = both[0]["service"], both[-1]["service"]
            got_a = (last[a] - first[a]) * weights.get(a, 1.0)
            got_b = (last[b] - first[b]) * weights.get(b, 1.0)
            ratios.append(got_a / got_b if got_b else float("inf"))
    out["weighted_service_ratio"] = ratios[0] if ratios else None
    return out


def vtc_bound(loads: list[TenantLoad], weights: dict[str, float], max_num_seqs: int) -> float:
    """VTC's bound on the backlogged service difference: twice the largest single
    admission's weighted service, times the requests that can run at once (those
    admitted together are all charged while they run)."""
    largest = max((ld.prompt[1] + 2 * ld.output[1]) / weights.get(ld.name, 1.0) for ld in loads)
    return 2 * largest * max_num_seqs


async def run_policy(address: str, sent: list[Sent], weights: dict[str, float]) -> dict[str, Any]:
    from async_engine.client import AsyncClient

    async with AsyncClient(address) as client:
        async for _ in client.generate([5, 6, 7], max_tokens=2):
            pass  # warm-up
        return await drive(client, sent, weights)


def cmd_tenants(args: argparse.Namespace) -> int:
    import copy

    import uvloop

    from async_engine.bench.server_process import spawn_server

    loads = parse_tenants(args.tenants)
    weights = _weights(args.tenant_weights)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs: list[tuple[str, list[TenantLoad]]] = [(p, loads) for p in policies]
    for name in filter(None, (args.alone or "").split(",")):
        alone = [ld for ld in loads if ld.name == name]
        if not alone:
            raise SystemExit(f"--alone {name}: no such tenant in --tenants")
        runs.append((f"{policies[0]} ({name} alone)", alone))
    results = {}
    for label, run_loads in runs:
        server_args = copy.copy(args)
        server_args.scheduling_policy = label.split()[0]
        server_args.backend = "grpc"
        proc, address, _ = spawn_server(server_args)
        try:
            sent = schedule(run_loads, args.vocab_size, args.workload_seed)
            slo = Slo(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
            out = report(sent, uvloop.run(run_policy(address, sent, weights)), weights, slo)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        results[label] = out
        print_report(label, out, weights)
    print(
        f"\nVTC bound for these loads (max_num_seqs {args.max_num_seqs}): "
        f"{vtc_bound(loads, weights, args.max_num_seqs):.0f}"
    )
    print_comparison(results, policies, args)
    return 0


def _weights(spec: str | None) -> dict[str, float]:
    from async_engine.core.config import EngineConfig

    return EngineConfig(tenant_weights=spec).resolved_tenant_weights()
