"""`async-engine bench replicas`: start, measure each phase, print, stop."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import urllib.request

from async_engine.bench.load import RequestRecord, Slo, summarize
from async_engine.bench.replicas.affinity import group_affinity, placements_from_counts
from async_engine.bench.replicas.cancel import CancelProbe, probes
from async_engine.bench.replicas.client import run_load
from async_engine.bench.replicas.options import workload_from
from async_engine.bench.replicas.processes import Replica, start_replicas, stop_replicas
from async_engine.bench.replicas.report import (
    PhaseResult,
    cancel_table,
    latency_table,
    placement_table,
    router_kv_table,
)
from async_engine.bench.replicas.routers import (
    Router,
    RouterInput,
    VllmRouter,
    default_policy,
    make_router,
)
from async_engine.bench.replicas.scrape import delta, scrape
from async_engine.bench.replicas.tap import Tap
from async_engine.bench.replicas.workload import (
    Prompt,
    Workload,
    build_prompts,
    burst_repeats,
    max_cached_tokens,
)

SETTLE_S = 0.6  # the replicas refresh their gauges every 0.25 s


@dataclasses.dataclass(slots=True)
class Setup:
    workload: Workload
    replicas: list[Replica]
    taps: list[Tap]
    model: str
    block_size: int


def cmd_replicas(args: argparse.Namespace) -> int:
    import uvloop

    if args.replicas < 1:
        raise SystemExit("--replicas must be >= 1")
    workload = workload_from(args)
    policy = args.policy or default_policy(args.router)
    # A bad policy or log level fails before anything starts.
    router = make_router(args.router, policy, args.router_log_level, args.sessions)
    print(f"starting {args.replicas} replicas ({args.device}) ...", flush=True)
    replicas = start_replicas(args, args.replicas, kv_events=policy == "kv_aware")
    try:
        phases, cancels = uvloop.run(_run(args, workload, router, replicas))
    finally:
        if router is not None:
            router.stop()
        stop_replicas(replicas)
    print(_header(args, workload, policy))
    print(latency_table(phases), end="\n\n")
    print(placement_table(phases), end="\n\n")
    if any(p.router_kv is not None for p in phases):
        print(router_kv_table(phases), end="\n\n")
    if cancels:
        print(cancel_table(cancels))
    if isinstance(router, VllmRouter):
        print(f"vllm-router log: {router.log_path}")
    if args.json:
        with open(args.json, "w") as f:
            out = {"phases": phases, "cancel": cancels}
            json.dump(out, f, indent=2, default=lambda o: dataclasses.asdict(o))
    return 0


def _header(args: argparse.Namespace, w: Workload, policy: str) -> str:
    router = args.router if args.router == "none" else f"{args.router} {policy}"
    return (
        f"\n{args.replicas} replicas ({args.device}, {args.sim_preset or '-'}), router {router}; "
        f"{w.groups} groups x {w.per_group} requests, prefix {w.prefix_tokens} + "
        f"{w.suffix_tokens} tokens, {w.output_tokens} out, {w.concurrency} streams"
        + (f" started {w.ramp_ms:g} ms apart\n" if w.ramp_ms else "\n")
    )


async def _run(
    args: argparse.Namespace, workload: Workload, router: Router | None, replicas: list[Replica]
) -> tuple[list[PhaseResult], dict[str, list[CancelProbe]]]:
    taps = [Tap("127.0.0.1", r.http_port) for r in replicas]
    for tap in taps:
        await tap.start()
    try:
        setup = Setup(workload, replicas, taps, await _model(replicas[0].url), 16)
        setup.block_size = (await asyncio.to_thread(scrape, replicas[0].url)).block_size or 16
        targets = [("1 replica direct", [taps[0].url])]
        targets.append((f"{len(taps)} direct, round robin", [t.url for t in taps]))
        base = None
        if router is not None:
            base = await asyncio.to_thread(router.start, _router_input(args, setup))
            targets.insert(0, (router.label, [base]))
        phases = []
        for salt, (name, urls) in enumerate(targets):
            through = router if router is not None and name == router.label else None
            phases.append(await _phase(setup, name, urls, salt, through))
        cancels = await _cancels(args, setup, router, base)
        return phases, cancels
    finally:
        for tap in taps:
            await tap.stop()


async def _model(url: str) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
            return str(json.loads(response.read())["data"][0]["id"])

    return await asyncio.to_thread(get)


def _router_input(args: argparse.Namespace, setup: Setup) -> RouterInput:
    from async_engine.cli.options import engine_options

    sources = [
        None if r.kv_events_port is None else f"tcp://127.0.0.1:{r.kv_events_port}"
        for r in setup.replicas
    ]
    urls = [t.url for t in setup.taps]
    return RouterInput(urls, sources, setup.block_size, setup.model, engine_options(args))


async def _warm_up(setup: Setup, urls: list[str], salt: int) -> None:
    """A few short requests first, so a cold connection pool or first-request cost is not
    charged to the phase; their prompts share nothing with the phase's."""
    rng = random.Random(-1 - salt)
    warm = [Prompt(-1, i, [rng.randrange(100, 32000) for _ in range(16)]) for i in range(4)]
    w = dataclasses.replace(setup.workload, output_tokens=4, concurrency=2, ramp_ms=0.0)
    await run_load(urls, setup.model, warm, w, f"warm{salt}")


async def _phase(
    setup: Setup, name: str, urls: list[str], salt: int, router: Router | None
) -> PhaseResult:
    """One phase; ``router``: the router its ``urls`` lead to (None: the replicas direct)."""
    replica_urls = [r.url for r in setup.replicas]
    own = router is not None and router.own_replicas
    await _warm_up(setup, urls, salt)
    await asyncio.sleep(SETTLE_S)
    before = await asyncio.gather(*(asyncio.to_thread(scrape, u) for u in replica_urls))
    kv_before = {} if router is None else await asyncio.to_thread(router.kv_lookups)
    for tap in setup.taps:
        tap.reset()
    prompts = build_prompts(setup.workload, salt)
    print(f"phase: {name} ({len(prompts)} requests) ...", flush=True)
    samples, duration = await run_load(urls, setup.model, prompts, setup.workload, f"p{salt}")
    await asyncio.sleep(SETTLE_S)
    after = await asyncio.gather(*(asyncio.to_thread(scrape, u) for u in replica_urls))
    kv_after = {} if router is None else await asyncio.to_thread(router.kv_lookups)
    records = [s.record for s in samples]
    result = PhaseResult(
        name=name,
        summary=summarize(records, duration, Slo()),
        tokens_per_event=_tokens_per_event(records),
        prompt_tokens=sum(len(p.tokens) for p in prompts),
        max_cached=max_cached_tokens(setup.workload, setup.block_size),
        cached_usage=sum(s.cached_tokens for s in samples),
        burst_repeats=burst_repeats(prompts, setup.workload),
    )
    if kv_after:  # a router that counts its KV lookups
        changes = {k: v - kv_before.get(k, 0.0) for k, v in kv_after.items()}
        result.router_kv = {k: n for k, n in changes.items() if n}
    if not own:  # a router with replicas of its own: ours saw none of it
        changes = [delta(b, a) for b, a in zip(before, after, strict=True)]
        result.requests_per_replica = [c.requests for c in changes]
        result.cached_metrics = sum(c.prefix_hits for c in changes)
        tallies = [tap.groups for tap in setup.taps]
        result.tapped_per_replica = [sum(t.values()) for t in tallies]
        result.affinity = group_affinity(placements_from_counts(tallies))
    return result


def _tokens_per_event(records: list[RequestRecord]) -> float:
    events = sum(len(r.chunk_times) for r in records)
    return sum(r.tokens for r in records) / events if events else float("nan")


async def _cancels(
    args: argparse.Namespace, setup: Setup, router: Router | None, base: str | None
) -> dict[str, list[CancelProbe]]:
    if args.cancel_probes <= 0:
        return {}
    replica_urls = [r.url for r in setup.replicas]
    paths = {"1 replica direct": setup.taps[0].url}
    if router is not None and base is not None and not router.own_replicas:
        paths = {router.label: base, **paths}
    out = {}
    for name, url in paths.items():
        print(f"cancel probes: {name} ...", flush=True)
        out[name] = await probes(
            url, setup.model, replica_urls, setup.taps, args.cancel_probes, name.replace(" ", "-")
        )
    return out
