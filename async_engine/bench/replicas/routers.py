"""The routers the bench can put in front of the replicas, behind one interface:
``start(RouterInput) -> base URL`` and ``stop()``.

- ``vllm-router``: its binary, given every replica's tap as a worker and ``--policy``;
  ``kv_aware`` also gets each replica's KV event endpoint (``--kv-event-source``), paired
  with that replica's tap URL, which is the worker URL it routes to; with ``--sessions``
  also session affinity (a request's ``x-session-id`` keeps it on its session's replica).
  The bench's prompts are token ids, which kv_aware matches against the events'
  ``token_ids`` as they are; a text or chat prompt it would first send to the worker's
  ``/v1/completions/render`` (or ``/v1/chat/completions/render``) for its ids. Its own KV
  view (lookups that found a prefix, or not) is read from its Prometheus port
  (``kv_lookups``).
- ``ray``: Ray Serve starts replicas of its own (``async_engine.ray_serve``) and routes
  between them (policy ``default`` or ``prefix-affinity``); the bench's replicas and taps
  do not see that traffic, so per-replica numbers are not available for it.
- ``none``: no router phase; the replicas are measured direct only.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Protocol

from async_engine.bench.replicas.processes import free_port
from async_engine.bench.replicas.scrape import parse_kv_lookups

ROUTERS = ("vllm-router", "ray", "none")
VLLM_POLICIES = ("power_of_two", "cache_aware", "kv_aware", "round_robin", "random")
ROUTER_LOG_LEVELS = ("debug", "info", "warning", "error")
RAY_POLICIES = ("default", "prefix-affinity")
START_TIMEOUT_S = 120.0
SESSION_TTL_S = 300  # kv_aware's session affinity lets a session go after this long idle


@dataclass(slots=True, frozen=True)
class RouterInput:
    worker_urls: list[str]  # one per replica (their taps)
    kv_event_sources: list[str | None]  # tcp://host:port per replica, None where unpublished
    block_size: int
    model: str
    engine_options: dict[str, Any] = field(default_factory=dict)  # for routers with own replicas


class Router(Protocol):
    label: str  # what the report calls it
    own_replicas: bool  # it runs replicas of its own: the bench's taps see none of its traffic

    def start(self, given: RouterInput) -> str: ...

    def stop(self) -> None: ...

    def kv_lookups(self) -> dict[str, float]:
        """The router's KV-index lookups so far, by result; {} where it keeps none."""
        ...


def default_policy(router: str) -> str:
    return RAY_POLICIES[0] if router == "ray" else "power_of_two"


def make_router(
    router: str, policy: str, log_level: str = "warning", sessions: bool = False
) -> Router | None:
    if router == "none":
        return None
    if router == "vllm-router":
        if policy not in VLLM_POLICIES:
            raise ValueError(f"vllm-router --policy must be one of {', '.join(VLLM_POLICIES)}")
        return VllmRouter(policy, log_level, sessions)
    if router == "ray":
        if policy not in RAY_POLICIES:
            raise ValueError(f"ray --policy must be one of {', '.join(RAY_POLICIES)}")
        return RayRouter(policy)
    raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")


class VllmRouter:
    own_replicas = False

    def __init__(self, policy: str, log_level: str = "warning", sessions: bool = False) -> None:
        if log_level not in ROUTER_LOG_LEVELS:
            raise ValueError(f"--router-log-level must be one of {', '.join(ROUTER_LOG_LEVELS)}")
        self.binary = _vllm_router_binary()  # missing: fail before any replica starts
        self.policy = policy
        self.log_level = log_level
        self.sessions = sessions and policy == "kv_aware"  # the one policy here that reads them
        self.label = f"vllm-router {policy}" + (" + sessions" if self.sessions else "")
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="bench-replicas-"), "router.log")
        self.metrics_url: str | None = None

    def command(self, given: RouterInput, port: int, metrics_port: int) -> list[str]:
        cmd = [self.binary, "--host", "127.0.0.1", "--port", str(port), "--policy", self.policy]
        cmd += ["--worker-urls", *given.worker_urls]
        # It waits this long between start-up health checks (default 30 s).
        cmd += ["--worker-startup-check-interval", "1", "--log-level", self.log_level]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        if self.policy == "kv_aware":
            cmd += self._kv_event_args(given)
        if self.sessions:
            cmd += ["--kv-aware-session-affinity-ttl-secs", str(SESSION_TTL_S)]
        return cmd

    @staticmethod
    def _kv_event_args(given: RouterInput) -> list[str]:
        if None in given.kv_event_sources:
            raise RuntimeError("kv_aware needs KV events: this engine has no --kv-events-endpoint")
        args = []
        for url, source in zip(given.worker_urls, given.kv_event_sources, strict=True):
            args += ["--kv-event-source", f"{url}={source}"]
        return args + [
            "--kv-event-block-size",
            str(given.block_size),
            "--kv-event-model",
            given.model,
        ]

    def start(self, given: RouterInput) -> str:
        port, metrics_port = free_port(), free_port()
        cmd = self.command(given, port, metrics_port)
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        self._wait_ready(url, len(given.worker_urls))
        return url

    def _wait_ready(self, url: str, workers: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited: {_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"{url}/readiness", timeout=2) as response:
                    if json.loads(response.read()).get("healthy_workers") == workers:
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"vllm-router not ready in {START_TIMEOUT_S} s: {_tail(self.log_path)}")

    def kv_lookups(self) -> dict[str, float]:
        if self.metrics_url is None:
            return {}
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
                return parse_kv_lookups(response.read().decode())
        except OSError:
            return {}  # an unreadable count shows as missing, not as a failed run

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RayRouter:
    own_replicas = True
    # Imported by name: ray is an optional extra, and only this router needs it.
    MODULE = "async_engine.ray_serve.launch"

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.label = f"ray serve {policy}"
        self._stop: Any = None

    def start(self, given: RouterInput) -> str:
        try:
            launch = importlib.import_module(self.MODULE)
        except ImportError as exc:
            raise RuntimeError(f"--router ray needs {self.MODULE} and ray[serve]: {exc}") from exc
        url, self._stop = launch.start_replicas(
            len(given.worker_urls), given.engine_options, router=self.policy
        )
        return url

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None

    def kv_lookups(self) -> dict[str, float]:
        return {}


def _vllm_router_binary() -> str:
    # Beside this Python first: a venv's scripts need not be on PATH.
    beside = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    found = beside if os.access(beside, os.X_OK) else shutil.which("vllm-router")
    if found is None:
        raise RuntimeError("vllm-router is not installed: pip install -e '.[router]'")
    return found


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
