"""`async-engine serve` in a subprocess, for the benches that measure it from outside."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import threading


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, int | None]:
    from async_engine.cli.options import engine_argv, engine_options

    cmd = [
        sys.executable,
        "-m",
        "async_engine.cli.main",
        "serve",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--http-port",
        str(_free_port()) if args.backend == "openai" or getattr(args, "http", False) else "0",
    ]
    cmd += engine_argv(engine_options(args))
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if record.get("event") == "server.ready":
                proc.ready = record  # type: ignore[attr-defined]  # its ports, for callers
                # Keep reading, or a full stderr pipe would one day block the server.
                threading.Thread(target=proc.stderr.read, daemon=True).start()
                if args.backend == "openai":
                    return (
                        proc,
                        f"http://127.0.0.1:{record['http_port']}",
                        record.get("metrics_port"),
                    )
                return proc, f"127.0.0.1:{record['port']}", record.get("metrics_port")
    raise RuntimeError(f"server exited with {proc.wait()} before it was ready")
