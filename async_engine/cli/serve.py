"""`async-engine serve`: the gRPC server on uvloop, drained on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
from typing import Any

from async_engine.cli.options import add_engine_args, engine_options

AUTH_ENV = "ASYNC_ENGINE_AUTH_TOKEN"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the model over gRPC and OpenAI-compatible HTTP")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument(
        "--metrics-port", type=int, default=9400, help="Prometheus /metrics port (-1: off)"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get on SIGTERM",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=60.0,
        help="a stream whose client reads nothing for this many seconds is cancelled",
    )
    p.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API port (0: off)"
    )
    p.add_argument("--http-host", default=None, help="HTTP bind address (default: --host)")
    p.add_argument(
        "--http-header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send a request's headers (slowloris)",
    )
    p.add_argument(
        "--http-body-timeout",
        type=float,
        default=30.0,
        help="seconds a request has to send its body, once its headers are in",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key (with --tls-cert)")
    p.add_argument(
        "--auth-token",
        default=None,
        help=f"require 'authorization: Bearer <token>' (default: ${AUTH_ENV})",
    )
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="JSON file of tokens, each with its principal, allowed tenants and most urgent "
        "priority (see async_engine/server/auth.py); request ids are scoped per principal",
    )
    p.add_argument("--max-message-bytes", type=int, default=4 << 20)
    add_limit_args(p)
    p.add_argument(
        "--profile-dir",
        default=None,
        help="enable on-demand step captures into DIR: `kill -USR2 <pid>` or "
        "`touch DIR/capture-now` traces the next 200 steps",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One flag per input limit (``Limits`` in server/codec.py), checked before any work."""
    from async_engine.server.codec import Limits

    group = parser.add_argument_group("input limits")
    for f in dataclasses.fields(Limits):
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            type=int,
            default=f.default,
            help=f"(default: {f.default})",
        )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from async_engine.core.engine import AsyncEngine
    from async_engine.server.app import ServerOptions
    from async_engine.server.codec import Limits
    from async_engine.server.logs import configure_logging

    configure_logging(args.log_level)
    _return_large_frees_to_the_os()
    token = args.auth_token if args.auth_token is not None else os.environ.get(AUTH_ENV) or None
    options = ServerOptions(
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        drain_timeout_s=args.drain_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_token=None if args.auth_token_file else token,
        auth_token_file=args.auth_token_file,
        max_message_bytes=args.max_message_bytes,
        limits=Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)}),
        http_port=args.http_port or None,
        http_host=args.http_host,
        http_header_timeout_s=args.http_header_timeout,
        http_body_timeout_s=args.http_body_timeout,
    )
    # The engine starts its device process before the loop exists (construction blocks).
    engine = AsyncEngine(**engine_options(args))
    if args.profile_dir:
        attach_profiler(engine, args.profile_dir)  # before the loop: signals need the main thread
    import structlog

    from async_engine.server.start import ServerStartError

    try:
        stopped_for_good = uvloop.run(_serve(engine, options))
    except ServerStartError as exc:
        structlog.get_logger("async_engine.server").error("server.start_failed", error=str(exc))
        return 2
    finally:
        engine.close()
    return 1 if stopped_for_good else 0


def _return_large_frees_to_the_os() -> None:
    """Refused 4 MB messages must leave no memory behind. glibc raises its mmap threshold
    each time a large block is freed, so after a few such messages their buffers come from
    the heap and stay with the process (measured: +35 MB RSS after 20 of them, +4 MB with a
    fixed 1 MiB threshold). gRPC reads a message in small slices on whichever of its
    threads is polling, and each thread's own arena keeps the freed slices: +8 to +20 MB
    after 20 refusals with the default arenas (8 per core), +0.2 MB with two."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, not adaptive
            libc.mallopt(-8, 2)  # M_ARENA_MAX
    except OSError:
        pass  # not glibc: nothing to tune


async def _serve(engine: Any, options: Any) -> bool:
    """Serve until a signal (drain, then stop) or until the engine stops for good (its
    device kept failing): True in that case, so that an orchestrator replaces the replica."""
    import structlog

    from async_engine.server.app import GenerationServer

    log = structlog.get_logger("async_engine.server.service")
    server = GenerationServer(engine, options)
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    await server.start()
    signalled = asyncio.create_task(signals.get())
    engine_stopped = asyncio.create_task(engine.stopped.wait())
    await asyncio.wait((signalled, engine_stopped), return_when=asyncio.FIRST_COMPLETED)
    if not signalled.done():
        signalled.cancel()
        log.error("server.engine_stopped", error=str(engine.fatal_error), action="exit")
        await server.stop(grace_s=0.5)
        await engine.aclose()
        return True
    engine_stopped.cancel()
    received = signalled.result()
    log.info("server.signal", signal=signal.Signals(received).name, action="drain")
    drain = asyncio.create_task(server.drain())
    second = asyncio.create_task(signals.get())
    # A second signal cuts the drain short: requests still in flight are aborted.
    await asyncio.wait((drain, second), return_when=asyncio.FIRST_COMPLETED)
    for task in (drain, second):
        task.cancel()
    await server.stop(grace_s=0.5)
    await engine.aclose()
    return False


def attach_profiler(engine: Any, out_dir: str) -> Any:
    """Entry points inject the profiler's on-demand capture; the engine never imports it."""
    from profiling.capture import attach

    return attach(engine, out_dir)
