"""The servers the intake tests send to: the simulated device behind gRPC and HTTP."""

from __future__ import annotations

from pathlib import Path

from server_helpers import start_server

from async_engine.server.app import BackgroundServer, ServerOptions


def sim_http_server(model: Path, options: ServerOptions, num_kv_blocks: int) -> BackgroundServer:
    """A server on a fast simulated device (0.2 ms steps): intake, not compute, is measured."""
    return start_server(
        model,
        options,
        device="sim",
        dtype="bfloat16",
        sim_step_ms=0.2,
        sim_token_us=0,
        sim_seq_us=0,
        sim_ctx_ns=0,
        num_kv_blocks=num_kv_blocks,
    )


def http_url(server: BackgroundServer, path: str) -> str:
    return f"http://127.0.0.1:{server.server.http_port}{path}"
