"""`bench replicas` flags (the engine flags come from EngineConfig, as for every bench)."""

from __future__ import annotations

import argparse

from async_engine.bench.replicas.routers import (
    RAY_POLICIES,
    ROUTER_LOG_LEVELS,
    ROUTERS,
    VLLM_POLICIES,
)
from async_engine.bench.replicas.workload import Workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="K: `serve` replicas to start")
    p.add_argument(
        "--router",
        choices=ROUTERS,
        default="vllm-router",
        help="what sits in front of the replicas (none: measure them direct only)",
    )
    p.add_argument(
        "--policy",
        default=None,
        help=f"the router's policy: vllm-router {'|'.join(VLLM_POLICIES)} (default "
        f"power_of_two; kv_aware gives each replica a KV event port), ray "
        f"{'|'.join(RAY_POLICIES)}",
    )
    p.add_argument("--groups", type=int, default=8, help="G: prompt groups (shared prefixes)")
    p.add_argument("--requests-per-group", type=int, default=8, help="M: requests per group")
    p.add_argument("--prefix-tokens", type=int, default=512, help="the groups' shared prefix")
    p.add_argument("--suffix-tokens", type=int, default=32, help="each request's own tail")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="streams in flight at once")
    p.add_argument(
        "--ramp-ms",
        type=float,
        default=0.0,
        help="stagger the streams' starts: stream k starts k * this ms in (0: all at once, "
        "an opening burst no KV-event-fed router can place)",
    )
    p.add_argument(
        "--sessions",
        action="store_true",
        help="each prompt group is a session: its requests carry x-session-id (as agent "
        "clients send a conversation id), and vllm-router's kv_aware keeps a session on one "
        "replica (--kv-aware-session-affinity-ttl-secs), even in the opening burst",
    )
    p.add_argument(
        "--cancel-probes",
        type=int,
        default=8,
        help="streams dropped mid-way, one at a time, per path (0: none)",
    )
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument(
        "--router-log-level",
        choices=ROUTER_LOG_LEVELS,
        default="warning",
        help="vllm-router's --log-level (debug: one line per routing decision, with the "
        "prefix tokens it credited); the log's path is printed at the end",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    # GPU-speed steps on any machine, and K of them side by side.
    p.set_defaults(device="sim", sim_preset="h200-135m")


def workload_from(args: argparse.Namespace) -> Workload:
    return Workload(
        groups=args.groups,
        per_group=args.requests_per_group,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        output_tokens=args.output_tokens,
        concurrency=args.concurrency,
        seed=args.workload_seed,
        ramp_ms=args.ramp_ms,
        sessions=args.sessions,
    )
