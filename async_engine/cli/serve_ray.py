"""`async-engine serve-ray`: the OpenAI HTTP API on Ray Serve replicas (the optional extra
``pip install 'async-engine[ray]'``), until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from async_engine.cli.options import add_engine_args, engine_options
from async_engine.ray_serve.coalesce import DEFAULT_MESSAGES_PER_S  # imports no Ray


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve-ray", help="serve the OpenAI HTTP API on Ray Serve replicas (extra: ray)"
    )
    add_engine_args(p)
    scale = p.add_argument_group("replicas")
    scale.add_argument("--replicas", type=int, default=1, help="a fixed number of replicas")
    scale.add_argument(
        "--autoscale-min", type=int, default=None, help="autoscale from this many replicas"
    )
    scale.add_argument("--autoscale-max", type=int, default=None, help="... up to this many")
    scale.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling aims at this many requests per replica (default: --max-num-seqs)",
    )
    p.add_argument(
        "--router",
        default="default",
        choices=["default", "prefix-affinity"],
        help="default: Serve's proxy calls a replica directly; prefix-affinity: an ingress "
        "reads each prompt and Ray's PrefixCacheAffinityRouter keeps shared prefixes together",
    )
    p.add_argument(
        "--ingress",
        default="proxy",
        choices=["proxy", "haproxy"],
        help="proxy: Serve's HTTP proxy (each streamed message a Ray message); haproxy: "
        "Serve's HAProxy direct ingress, replicas serving HTTP themselves (Ray 2.60 flags)",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument(
        "--messages-per-s",
        type=float,
        default=DEFAULT_MESSAGES_PER_S,
        help="a replica's streamed messages per second through Ray; past it, each stream's "
        "events carry several tokens (0: one message per event)",
    )
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds a stopping replica's requests get to finish",
    )
    p.add_argument(
        "--ray-address", default=None, help="a running Ray cluster (default: start one here)"
    )
    p.set_defaults(func=cmd_serve_ray)


def cmd_serve_ray(args: argparse.Namespace) -> int:
    from async_engine.ray_serve import RayMissingError, require_ray

    try:
        require_ray()
    except RayMissingError as exc:
        print(f"async-engine serve-ray: {exc}", file=sys.stderr)
        return 2
    from async_engine.ray_serve.launch import start_replicas

    url, stop = start_replicas(
        replica_count(args),
        engine_options(args),
        router=args.router,
        ingress=args.ingress,
        host=args.host,
        port=args.port,
        options=replica_options(args),
        ray_address=args.ray_address,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout,
    )
    print(f"serving at {url}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        wait_for_signal()
    finally:
        stop()
    return 0


def replica_count(args: argparse.Namespace) -> Any:
    """``--replicas``, or autoscaling when a bound is given."""
    from async_engine.ray_serve.app import Autoscaling

    if args.autoscale_min is None and args.autoscale_max is None:
        return args.replicas
    low = args.autoscale_min if args.autoscale_min is not None else 1
    high = args.autoscale_max if args.autoscale_max is not None else max(low, 2)
    return Autoscaling(low, high, args.target_ongoing_requests)


def replica_options(args: argparse.Namespace) -> Any:
    from async_engine.ray_serve.serving import ReplicaOptions

    return ReplicaOptions(messages_per_s=args.messages_per_s or None)


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM; Serve then drains its replicas as it stops them."""
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    while not stopped.wait(1.0):
        pass
