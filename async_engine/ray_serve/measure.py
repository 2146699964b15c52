"""``python -m async_engine.ray_serve.measure``: the same load on K replicas, direct (each an
``async-engine serve``, requests spread round robin) and through Ray Serve (``build_app``),
side by side: throughput, TTFT and ITL percentiles, errors and tokens per streamed event.

A short check, not a benchmark suite: ``async-engine bench replicas`` compares routers.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

from async_engine.bench.load import (
    LoadSpec,
    RequestRecord,
    RequestSpec,
    Slo,
    make_requests,
    summarize,
)
from async_engine.bench.openai_load import HttpTarget, openai_sender
from async_engine.bench.serve import on_tokens, run_load
from async_engine.bench.server_process import spawn_server
from async_engine.cli.options import add_engine_args, engine_options
from async_engine.ray_serve.coalesce import DEFAULT_MESSAGES_PER_S


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m async_engine.ray_serve.measure")
    add_engine_args(p)
    p.set_defaults(device="sim")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--rate", type=float, default=0.0, help="req/s, Poisson (0: all at once)")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--min-output", type=int, default=64)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--router", default="default", choices=["default", "prefix-affinity"])
    p.add_argument("--ingress", default="proxy", choices=["proxy", "haproxy"])
    p.add_argument(
        "--messages-per-s",
        type=float,
        default=DEFAULT_MESSAGES_PER_S,
        help="per-replica Ray message budget (default: the shipped one; 0: none)",
    )
    p.add_argument("--only", choices=["direct", "ray"], default=None)
    p.add_argument("--json", default=None, help="write the figures to this file")
    return p.parse_args(argv)


async def drive(urls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The load, spread round robin over ``urls``; the summary, with tokens per event."""
    senders = itertools.cycle([openai_sender(HttpTarget(u), "default", on_tokens) for u in urls])

    async def send(spec: RequestSpec, rec: RequestRecord) -> None:
        await next(senders)(spec, rec)

    vocab = 49152
    await run_load(
        send, make_requests(LoadSpec(num_requests=4, min_output=4, max_output=8), 1.0, vocab)
    )
    spec = LoadSpec(
        num_requests=args.requests,
        min_prompt=args.min_prompt,
        max_prompt=args.max_prompt,
        min_output=args.min_output,
        max_output=args.max_output,
        burst=args.rate <= 0,
    )
    records, duration = await run_load(send, make_requests(spec, args.rate or 1.0, vocab))
    summary = summarize(records, duration, Slo())
    events = sum(len(r.chunk_times) for r in records)
    summary["tokens_per_event"] = sum(r.tokens for r in records) / max(1, events)
    summary["error_samples"] = sorted({r.error for r in records if r.error})[:3]
    return summary


def direct(args: argparse.Namespace) -> dict[str, Any]:
    servers = []
    try:
        for _ in range(args.replicas):
            ns = argparse.Namespace(backend="openai", **engine_options(args))
            servers.append(spawn_server(ns))
        return asyncio.run(drive([url for _, url, _ in servers], args))
    finally:
        for proc, _, _ in servers:
            proc.terminate()
        for proc, _, _ in servers:
            proc.wait(timeout=30)


def through_ray(args: argparse.Namespace) -> dict[str, Any]:
    from async_engine.ray_serve.launch import start_replicas
    from async_engine.ray_serve.serving import ReplicaOptions

    options = ReplicaOptions(messages_per_s=args.messages_per_s or None)
    url, stop = start_replicas(
        args.replicas,
        engine_options(args),
        router=args.router,
        ingress=args.ingress,
        options=options,
    )
    try:
        return asyncio.run(drive([url], args))
    finally:
        stop()


def report(results: dict[str, dict[str, Any]], write: Callable[[str], Any]) -> None:
    rows = [
        ("output tok/s", "output_tokens_per_s", 1.0),
        ("TTFT p95 ms", ("ttft_s", "p95"), 1e3),
        ("ITL p50 ms", ("itl_s", "p50"), 1e3),
        ("ITL p95 ms", ("itl_s", "p95"), 1e3),
        ("tokens/event", "tokens_per_event", 1.0),
        ("errors", "errors", 1.0),
    ]
    names = list(results)
    write(f"{'':<14}" + "".join(f"{n:>12}" for n in names))
    for label, key, scale in rows:
        cells = []
        for name in names:
            value = results[name]
            for part in key if isinstance(key, tuple) else (key,):
                value = value[part]
            cells.append(f"{value * scale:>12.2f}")
        write(f"{label:<14}" + "".join(cells))
    if len(names) == 2:
        d, r = (results[n] for n in names)
        write(f"throughput ray/direct: {r['output_tokens_per_s'] / d['output_tokens_per_s']:.3f}")
        write(f"ITL p95 ray/direct: {r['itl_s']['p95'] / d['itl_s']['p95']:.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    if args.only in (None, "direct"):
        results["direct"] = direct(args)
    if args.only in (None, "ray"):
        results["ray"] = through_ray(args)
    report(results, print)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2, default=str)
    return 0 if all(r["errors"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
