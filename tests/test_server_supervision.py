"""The server while its device is lost: health, load, the statuses streams end with, and
`serve` exiting non-zero once restarts are spent (an orchestrator then replaces it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_helpers import start_server

from async_engine.client import AsyncClient, Chunk, Unavailable
from async_engine.server.app import ServerOptions

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SERVING = health_pb2.HealthCheckResponse.SERVING


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        return reply.status


async def wait_health(address: str, serving: bool, timeout: float) -> float:
    start = time.monotonic()
    while (await health(address) == SERVING) != serving:
        if time.monotonic() - start > timeout:
            raise AssertionError(f"health did not turn {'SERVING' if serving else 'NOT_SERVING'}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_a_killed_device_turns_health_off_then_on_and_streams_end_unavailable(
    tiny_model: Path,
):
    server = start_server(
        tiny_model, ServerOptions(port=0, metrics_port=None, metrics_interval_s=0.1)
    )
    try:
        async with AsyncClient(server.address) as client:
            started = asyncio.Event()

            async def stream() -> Exception | None:
                try:
                    async for event in client.generate([5] * 4, max_tokens=400, **GREEDY):
                        if isinstance(event, Chunk):
                            started.set()
                except Unavailable as exc:
                    return exc
                return None

            tasks = [asyncio.create_task(stream()) for _ in range(4)]
            await started.wait()
            os.kill(server.engine.device.pid, signal.SIGKILL)
            assert await wait_health(server.address, serving=False, timeout=1.0) < 1.0
            await wait_health(server.address, serving=True, timeout=30)
            ended = await asyncio.gather(*tasks)
            lost = [e for e in ended if e is not None]
            assert lost and all(e.reason == "DEVICE_LOST" for e in lost)
            load = await client.load()
            assert (load.device_state, load.device_restarts) == ("serving", 1)
            text = [e async for e in client.generate([7] * 4, max_tokens=8, **GREEDY)]
            assert sum(len(e.token_ids) for e in text if isinstance(e, Chunk)) == 8
    finally:
        server.close()


def device_pid(serve_pid: int) -> int:
    with open(f"/proc/{serve_pid}/task/{serve_pid}/children") as f:
        return int(f.read().split()[0])


def test_serve_exits_1_when_the_device_cannot_be_replaced(tiny_model: Path):
    flags = (
        "--dtype float32 --device cpu --port 0 --metrics-port -1 --http-port 0 "
        "--device-threads 1 --device-restart-limit 0"
    )
    cmd = [sys.executable, "-m", "async_engine.cli.main", "serve", "--model", str(tiny_model)]
    cmd += flags.split()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if '"server.ready"' in line:
                break
        os.kill(device_pid(proc.pid), signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        events = [json.loads(line).get("event") for line in proc.stderr if line.startswith("{")]
        assert "server.engine_stopped" in events
    finally:
        if proc.poll() is None:
            proc.kill()
            pytest.fail("serve kept running with a dead device")


def test_over_http_a_whole_answer_survives_a_device_kill_and_a_stream_is_told(tiny_model: Path):
    import http.client
    import threading

    server = start_server(tiny_model, ServerOptions(port=0, metrics_port=None, http_port=0))
    try:
        engine = server.engine

        def kill_once_running() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                running = list(engine.scheduler.running)
                if running and len(running[0].output_ids) > 5:
                    os.kill(engine.device.pid, signal.SIGKILL)
                    return
                time.sleep(0.005)

        def post(stream: bool) -> tuple[int, str]:
            body = {
                "model": "default",
                "prompt": [5, 6, 7],
                "max_tokens": 300,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": stream,
            }
            conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
            )
            resp = conn.getresponse()
            return resp.status, resp.read().decode()

        for stream in (False, True):
            killer = threading.Thread(target=kill_once_running)
            killer.start()
            status, text = post(stream)
            killer.join()
            assert status == 200
            if stream:  # headers went out before the loss: the error comes in-band
                assert '"code": "device_lost"' in text
            else:  # its client had seen nothing: it started over on the new device
                assert json.loads(text)["usage"]["completion_tokens"] == 300
        deadline = time.monotonic() + 30
        while engine.supervisor.restarts < 2:  # the second restart may still be under way
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.close()
