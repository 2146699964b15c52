"""`async-engine bench offline|serve|prefill`: benchmarks, not tests."""

from __future__ import annotations

from typing import Any

from async_engine.bench import offline, prefill, serve, soak
from async_engine.cli.options import add_engine_args


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (not tests)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    p = kinds.add_parser("offline", help="throughput vs HF, overlap on/off, roofline")
    add_engine_args(p)
    offline.add_arguments(p)
    p.set_defaults(func=offline.cmd_offline)
    p = kinds.add_parser(
        "serve", help="online load over gRPC: latency percentiles, goodput, capacity"
    )
    add_engine_args(p)
    serve.add_arguments(p)
    p.set_defaults(func=serve.cmd_serve_bench)
    p = kinds.add_parser("prefill", help="one long prompt's prefill speed (vs llama-bench)")
    add_engine_args(p)
    prefill.add_arguments(p)
    p.set_defaults(func=prefill.cmd_prefill)
    p = kinds.add_parser(
        "soak", help="long mixed load with cancels: leaks, ghost requests, RSS growth, errors"
    )
    add_engine_args(p)
    soak.add_arguments(p)
    p.set_defaults(func=soak.cmd_soak)
