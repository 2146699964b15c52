"""K `async-engine serve` replicas as subprocesses, each with its own ports."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from async_engine.cli.options import engine_argv, engine_options

READY_TIMEOUT_S = 300.0


@dataclass(slots=True)
class Replica:
    proc: subprocess.Popen
    http_port: int
    kv_events_port: int | None  # where its KV events are published (None: not published)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


# Ports handed to replicas and routers are picked below the ephemeral range: a port the OS
# hands out for bind(0) or an outgoing connection (a replica's gRPC port, the router's
# connections) can be taken between our pick and the replica's bind, which then fails.
PICK_RANGE = (20000, 32768)  # Linux's ephemeral range starts at 32768 by default
PICK_TRIES = 50


def free_port() -> int:
    """A TCP port free on every interface now (KV endpoints bind ``*``)."""
    low, high = PICK_RANGE
    for _ in range(PICK_TRIES):
        port = random.randrange(low, min(high, _ephemeral_start()))
        if _bindable(port):
            return port
    with socket.socket() as sock:  # all taken: let the OS choose
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(int(f.read().split()[0]), PICK_RANGE[0] + 1)
    except (OSError, ValueError, IndexError):
        return PICK_RANGE[1]


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


def replica_options(args: argparse.Namespace, kv_events: bool) -> tuple[dict[str, Any], int | None]:
    """One replica's engine options: the command line's, with a KV events port of its own
    (when asked for and when this engine has the option: a shared one would not bind)."""
    options = engine_options(args)
    # One endpoint cannot bind twice: each replica gets a port of its own, or none.
    options.pop("kv_events_endpoint", None)
    options.pop("kv_events_replay_endpoint", None)
    if not (kv_events and has_kv_events(args)):
        return options, None
    port = free_port()
    options["kv_events_endpoint"] = f"tcp://*:{port}"  # `*` binds; a host would connect
    return options, port


def has_kv_events(args: argparse.Namespace) -> bool:
    """Whether `serve` can publish KV events (`--kv-events-endpoint`): this command's engine
    flags are generated from the same EngineConfig fields as `serve`'s."""
    return hasattr(args, "kv_events_endpoint")


def spawn(args: argparse.Namespace, kv_events: bool) -> Replica:
    options, kv_port = replica_options(args, kv_events)
    http_port = free_port()
    cmd = [sys.executable, "-m", "async_engine.cli.main", "serve", "--port", "0"]
    cmd += ["--metrics-port", "-1", "--http-port", str(http_port)]
    cmd += engine_argv(options)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    return Replica(proc, http_port, kv_port)


def wait_ready(replica: Replica) -> None:
    """Block until the replica logs server.ready; then keep its stderr drained."""
    proc = replica.proc
    assert proc.stderr is not None
    timer = threading.Timer(READY_TIMEOUT_S, proc.kill)
    timer.start()
    tail: list[str] = []
    try:
        for line in proc.stderr:
            tail = (tail + [line])[-20:]
            with contextlib.suppress(json.JSONDecodeError):
                if json.loads(line).get("event") == "server.ready":
                    # A full stderr pipe would one day block the server.
                    threading.Thread(target=proc.stderr.read, daemon=True).start()
                    return
    finally:
        timer.cancel()
    raise RuntimeError(f"replica exited with {proc.wait()} before it was ready:\n{''.join(tail)}")


def start_replicas(args: argparse.Namespace, count: int, kv_events: bool) -> list[Replica]:
    """``count`` replicas started side by side (their start-up overlaps), all ready."""
    replicas = [spawn(args, kv_events) for _ in range(count)]
    try:
        for replica in replicas:
            wait_ready(replica)
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas


def stop_replicas(replicas: list[Replica], timeout_s: float = 30.0) -> None:
    """SIGTERM (each drains), then SIGKILL what is still there."""
    for replica in replicas:
        if replica.proc.poll() is None:
            replica.proc.send_signal(signal.SIGTERM)
    for replica in replicas:
        try:
            replica.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            replica.proc.kill()
            replica.proc.wait()
