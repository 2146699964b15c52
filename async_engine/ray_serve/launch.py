"""Start K replicas under Ray Serve on this machine (or a running Ray cluster) and return
where they answer: for ``serve-ray``, benchmarks and tests."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

from async_engine.core.config import EngineConfig
from async_engine.ray_serve.app import Autoscaling, build_app
from async_engine.ray_serve.serving import ReplicaOptions

APP_NAME = "async-engine"
INGRESSES = ("proxy", "haproxy")
# Serve's HAProxy ingress (Ray 2.60): HAProxy in front, each replica serving HTTP itself,
# so a streamed token costs no Ray message. Read by every Ray process at start.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
# The proxy calls replicas over Serve's gRPC transport instead of Ray actor tasks: the
# same 2 sim replicas streamed 10.8-12.0k tokens/s instead of 7.4-10.0k (the proxy's
# per-message work is what caps them). Part of Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED.
PROXY_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1"}


def start_replicas(
    replicas: int | Autoscaling,
    engine: EngineConfig | dict[str, Any] | None = None,
    *,
    router: str = "default",
    ingress: str = "proxy",
    host: str = "127.0.0.1",
    port: int = 0,
    options: ReplicaOptions | None = None,
    ray_address: str | None = None,
    graceful_shutdown_timeout_s: float = 30.0,
) -> tuple[str, Callable[[], None]]:
    """Deploy the engine on ``replicas`` Serve replicas behind Serve's HTTP proxy; return
    the base URL (``http://host:port``, the OpenAI API under ``/v1``) once every replica
    answers, and a stop function that shuts Serve down (and Ray, if this call started it).
    ``port=0`` picks a free port. ``ingress``: ``"proxy"`` (Serve's HTTP proxy, calling
    replicas over gRPC) or ``"haproxy"`` (Serve's HAProxy direct ingress). Both are flags
    Ray's processes read as they start, so they apply to the Ray this call starts; a
    running cluster (``ray_address``) keeps its own, and refuses ``"haproxy"`` here."""
    if ingress not in INGRESSES:
        raise ValueError(f"ingress must be one of {', '.join(INGRESSES)}, got {ingress!r}")
    started_ray = not ray.is_initialized()
    if ingress == "haproxy" and (not started_ray or ray_address is not None):
        raise ValueError(
            "ingress='haproxy' starts its own Ray; on a running cluster start every node "
            "with " + " ".join(f"{k}={v}" for k, v in HAPROXY_ENV.items())
        )
    if started_ray:
        _start_ray(HAPROXY_ENV if ingress == "haproxy" else PROXY_ENV, ray_address)
    port = port or _free_port(host)
    try:
        serve.start(http_options={"host": host, "port": port})
        app = build_app(
            engine,
            replicas,
            router,
            options,
            graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
        )
        serve.run(app, name=APP_NAME, route_prefix="/")
        url = f"http://{host}:{port}"
        _wait_ready(url)
    except BaseException:
        _stop(started_ray)
        raise
    return url, lambda: _stop(started_ray)


def _start_ray(flags: dict[str, str], address: str | None) -> None:
    """Start (or join) Ray with Serve's ``flags`` in the environment its processes inherit;
    this process's environment is left as it was. An operator's own setting wins."""
    saved = dict(os.environ)
    for name, value in flags.items():
        os.environ.setdefault(name, value)
    try:
        ray.init(
            address=address,
            include_dashboard=False,
            logging_level="warning",
            log_to_driver=False,
            # Ray lowers its workers' priority (nice 15) by default: on a machine shared
            # with other work, the replicas would be the ones starved.
            _system_config={"worker_niceness": 0},
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _stop(started_ray: bool) -> None:
    """Delete the application first, while the proxy still relays: Serve then drains each
    replica (its streams run to their end, up to ``graceful_shutdown_timeout_s``) before
    it stops. Shutting Serve down at once would cut them with the proxy."""
    with contextlib.suppress(Exception):  # e.g. a start that failed before deploying
        serve.delete(APP_NAME)
    serve.shutdown()
    if started_ray:
        ray.shutdown()


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    """serve.run returns once replicas are up; the proxy may take a moment longer to route."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"Serve did not answer at {url} within {timeout_s} s")
        time.sleep(0.2)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
