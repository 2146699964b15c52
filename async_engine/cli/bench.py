"""`async-engine bench offline|serve|prefill|spec|soak|replicas`: benchmarks, not tests."""

from __future__ import annotations

from typing import Any

from async_engine.bench import offline, prefill, serve, soak, spec
from async_engine.bench.replicas import command as replicas
from async_engine.bench.replicas import options as replicas_options
from async_engine.cli.options import add_engine_args

# name -> (help, the module's argument adder, its command)
BENCHES = {
    "offline": (
        "throughput vs HF, overlap on/off, roofline",
        offline.add_arguments,
        offline.cmd_offline,
    ),
    "serve": (
        "online load over gRPC: latency percentiles, goodput, capacity",
        serve.add_arguments,
        serve.cmd_serve_bench,
    ),
    "prefill": (
        "one long prompt's prefill speed (vs llama-bench)",
        prefill.add_arguments,
        prefill.cmd_prefill,
    ),
    "spec": (
        "speculative decoding off vs each drafter, agent and plain workloads, by batch size",
        spec.add_arguments,
        spec.cmd_spec,
    ),
    "soak": (
        "long mixed load with cancels: leaks, ghost requests, RSS growth, errors",
        soak.add_arguments,
        soak.cmd_soak,
    ),
    "replicas": (
        "K serve replicas behind a router: latency, split, prefix affinity, cancel lag",
        replicas_options.add_arguments,
        replicas.cmd_replicas,
    ),
}


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (not tests)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, (help_text, add_arguments, command) in BENCHES.items():
        p = kinds.add_parser(name, help=help_text)
        add_engine_args(p)
        add_arguments(p)
        p.set_defaults(func=command)
