"""`async-engine serve` as a process: SIGTERM drains and exits 0; TLS; a failed start."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_helpers import Transcript, check_stream_rules, collect, start_server

from async_engine.client import AsyncClient, Chunk, Unavailable
from async_engine.server.app import ServerOptions

GREEDY = {"temperature": 0.0, "ignore_eos": True}


class ServeProcess:
    def __init__(self, model: Path, *extra: str, own_group: bool = False) -> None:
        flags = (
            "--dtype float32 --device cpu --port 0 --metrics-port -1 --http-port 0 "
            "--num-kv-blocks 128 --device-threads 1"
        )
        cmd = [sys.executable, "-m", "async_engine.cli.main", "serve", "--model", str(model)]
        cmd += [*flags.split(), *extra]
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, text=True, start_new_session=own_group
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, event: str, timeout: float = 60) -> dict:
        while True:
            line = self.lines.get(timeout=timeout)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # library warnings are not ours
            if record.get("event") == event:
                return record


async def health_status(address: str) -> int:
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        return reply.status


async def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(
    tiny_model: Path,
) -> None:
    serve = ServeProcess(tiny_model, "--drain-timeout", "30")
    await _drains_on(serve, lambda: serve.proc.send_signal(signal.SIGTERM))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_a_signal_to_the_whole_process_group_drains_too(tiny_model: Path, sig) -> None:
    """Ctrl-C in a terminal, `timeout` and service managers signal every process of the
    group, the device's included: it must outlive the drain, not end the streams."""
    serve = ServeProcess(tiny_model, "--drain-timeout", "30", own_group=True)
    await _drains_on(serve, lambda: os.killpg(serve.proc.pid, sig))


async def _drains_on(serve: ServeProcess, send_signal) -> None:
    try:
        ready = await asyncio.to_thread(serve.wait_for, "server.ready")
        address = f"127.0.0.1:{ready['port']}"
        assert await health_status(address) == health_pb2.HealthCheckResponse.SERVING
        async with AsyncClient(address) as client:
            first = asyncio.Event()

            async def in_flight() -> Transcript:
                out = Transcript()
                async for event in client.generate([5] * 4, max_tokens=900, **GREEDY):
                    out.add(event)
                    if isinstance(event, Chunk):
                        first.set()
                return out

            task = asyncio.create_task(in_flight())
            await asyncio.wait_for(first.wait(), 30)
            send_signal()
            await asyncio.to_thread(serve.wait_for, "server.draining")
            assert await health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(Unavailable) as info:
                await collect(client, [1, 2, 3], max_tokens=2)
            assert info.value.reason == "DRAINING"
            t = await asyncio.wait_for(task, 60)
        check_stream_rules(t)
        assert t.finished[0].reason == "length" and len(t.tokens[0]) == 900
        assert await asyncio.to_thread(serve.proc.wait, 30) == 0
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
            serve.proc.wait()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_server_serves_clients_that_trust_its_certificate(
    tiny_model: Path, tmp_path: Path
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *"openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost".split(),
            *("-keyout", str(key), "-out", str(cert)),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "RANDFILE": str(tmp_path / "rnd")},
    )
    options = ServerOptions(port=0, metrics_port=None, tls_cert=str(cert), tls_key=str(key))
    server = await asyncio.to_thread(start_server, tiny_model, options, num_kv_blocks=64)
    try:
        async with AsyncClient(
            f"localhost:{server.port}", root_certificates=cert.read_bytes()
        ) as c:
            t = await collect(c, [1, 2, 3], max_tokens=3, **GREEDY)
        check_stream_rules(t)
    finally:
        await asyncio.to_thread(server.close)


async def test_a_running_server_captures_steps_on_demand_without_restart(
    tiny_model: Path, tmp_path: Path
) -> None:
    serve = ServeProcess(tiny_model, "--profile-dir", str(tmp_path))
    try:
        ready = await asyncio.to_thread(serve.wait_for, "server.ready")
        (tmp_path / "capture-now").write_text("5")
        async with AsyncClient(f"127.0.0.1:{ready['port']}") as client:
            for _ in range(40):
                await collect(client, [7, 8, 9], max_tokens=20, **GREEDY)
                if any(p.joinpath("report.txt").exists() for p in tmp_path.glob("capture-*/")):
                    break
                await asyncio.sleep(0.2)
        captures = [p for p in tmp_path.glob("capture-*/") if (p / "report.txt").exists()]
        assert captures, "no capture was written"
        assert (captures[0] / "trace.json").stat().st_size > 0
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        serve.proc.wait(timeout=60)


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--http-port"])
def test_a_busy_port_is_named_and_the_server_exits_2(flag: str):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        ports = {"--port": "0", "--metrics-port": "-1", "--http-port": "0", flag: port}
        cmd = [sys.executable, "-m", "async_engine.cli.main", "serve", "--device", "sim"]
        cmd += [x for item in ports.items() for x in item]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"127.0.0.1:{port}" in proc.stderr and "server.start_failed" in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_a_start_that_fails_part_way_stops_exactly_what_had_started(
    default_model: Path,
) -> None:
    import socket

    from async_engine.core.engine import AsyncEngine
    from async_engine.server.app import GenerationServer
    from async_engine.server.start import ServerStartError

    engine = AsyncEngine(model=str(default_model), device="sim")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        grpc_port = busy.getsockname()[1]
        # The metrics endpoint, its refresh, the stall watch and the HTTP API start before
        # gRPC, which cannot listen.
        options = ServerOptions(port=grpc_port, metrics_port=0, http_port=0, warmup=False)
        server = GenerationServer(engine, options)
        before = asyncio.all_tasks()
        with pytest.raises(ServerStartError, match=f"127.0.0.1:{grpc_port}"):
            await server.start()
    try:
        assert server.metrics_port and server.http_port, "both had started"
        for port in (server.metrics_port, server.http_port):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert asyncio.all_tasks() <= before, "no task of the server outlives its start"
        assert not engine.supervisor.listeners
        await server.stop()  # stopping a server that never started is harmless
    finally:
        await engine.aclose()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


async def test_refused_4_mb_messages_leave_no_memory_behind(tiny_model: Path) -> None:
    from async_engine.client import ResourceExhausted

    serve = ServeProcess(tiny_model)
    try:
        ready = await asyncio.to_thread(serve.wait_for, "server.ready")
        async with AsyncClient(f"127.0.0.1:{ready['port']}") as client:
            await collect(client, [5, 6, 7], max_tokens=2)
            before = _rss_mb(serve.proc.pid)
            for _ in range(20):
                with pytest.raises(ResourceExhausted):
                    await collect(client, "x" * (4 << 20), max_tokens=1)
            await asyncio.sleep(1.0)
            grown = _rss_mb(serve.proc.pid) - before
        assert grown < 20, f"RSS grew {grown:.0f} MB (glibc kept the refused buffers)"
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        if await asyncio.to_thread(serve.proc.wait, 30) is None:
            serve.proc.kill()


def test_http_health_says_not_serving_until_the_warm_up_has_run(tiny_model, monkeypatch):
    import urllib.error
    import urllib.request

    from async_engine.server.app import GenerationServer

    warming, release, seen = threading.Event(), threading.Event(), {}
    original = GenerationServer._warm_up

    async def held_warm_up(self):
        seen["server"] = self
        warming.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
        await original(self)

    def health() -> int:
        url = f"http://127.0.0.1:{seen['server'].http_port}/health"
        try:
            return urllib.request.urlopen(url, timeout=5).status
        except urllib.error.HTTPError as exc:
            return exc.code

    monkeypatch.setattr(GenerationServer, "_warm_up", held_warm_up)
    options = ServerOptions(port=0, metrics_port=None, http_port=0)
    started: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: started.put(start_server(tiny_model, options))).start()
    assert warming.wait(60)
    try:
        assert health() == 503
    finally:
        release.set()
    server = started.get(timeout=60)
    try:
        assert health() == 200
    finally:
        server.close()
