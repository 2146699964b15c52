"""``bench soak --hostile``: what hostile clients cost everyone else.

Each hostile kind runs in two loops beside a well-behaved client; the table shows that
client's 4-token latency (median of 15, and its ratio to the latency alone) and the event
loop's worst stall, measured as the slowest GetLoad (an RPC answered by the loop alone)
polled every 50 ms. Hostile kinds: huge and long prompts, maximal stop lists, huge chats
(1 MiB, 1,000 messages, one that must be templated), HTTP chats of 4 MB and with tools,
bodies nested 100k deep, grammar bombs; then 100 slowloris sockets and 100 bodies that never
end held open at once; then the server's RSS while 24 streams with logprobs are never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from async_engine.bench.hostile_kinds import grpc_kinds, http_kinds


async def latency(client: Any, count: int = 15) -> float:
    """Median seconds of a 4-token greedy request."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        async for _ in client.generate(
            [7, 8, 9, 10], max_tokens=4, temperature=0.0, ignore_eos=True
        ):
            pass
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def worst_stall(client: Any, stop: asyncio.Event) -> float:
    """The slowest GetLoad, polled every 50 ms until ``stop``: the event loop's stall."""
    worst = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        await client.load()
        worst = max(worst, time.perf_counter() - start)
        await asyncio.sleep(0.05)
    return worst


async def beside(
    client: Any, kind: str, address: str, http_port: int | None, loops: int = 2
) -> tuple[float, float]:
    """(4-token latency, worst loop stall) while hostile ``kind`` runs in ``loops`` loops, in
    a process of its own: run here, its own work (encoding 4 MB bodies) would be measured."""
    argv = [
        sys.executable,
        "-m",
        "async_engine.bench.hostile",
        kind,
        address,
        str(http_port or 0),
        str(loops),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    stop = asyncio.Event()
    try:
        assert proc.stdout is not None
        await asyncio.to_thread(proc.stdout.readline)  # its loops have started
        probe = asyncio.create_task(worst_stall(client, stop))
        took = await latency(client)
        stop.set()
        return took, await probe
    finally:
        stop.set()
        proc.kill()
        proc.wait()


async def _hostile_loops(kind: str, address: str, http_port: int, loops: int) -> None:
    from async_engine.client import AsyncClient

    async with AsyncClient(address) as client:
        hostile = {**grpc_kinds(client), **(http_kinds(http_port) if http_port else {})}[kind]

        async def loop() -> None:
            while True:
                with contextlib.suppress(Exception):
                    await hostile()

        tasks = [asyncio.create_task(loop()) for _ in range(loops)]
        await asyncio.sleep(0.2)
        print("started", flush=True)
        await asyncio.gather(*tasks)


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def held_open(port: int, count: int, body: bool) -> list[Connection]:
    """``count`` connections that each send part of a request and no more: slowloris
    headers (``body`` False) or a body that never ends."""
    connections = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        if body:
            head += b'Content-Type: application/json\r\nContent-Length: 999\r\n\r\n{"m'
        writer.write(head)
        connections.append((reader, writer))
    return connections


async def trickle(connections: list[Connection], stop: asyncio.Event) -> None:
    """A header byte a second on each slowloris socket, until the server cuts it off."""
    while not stop.is_set():
        for _, writer in connections:
            if not writer.is_closing():
                with contextlib.suppress(OSError):
                    writer.write(b"X")
        await asyncio.sleep(1.0)


async def cut_off(connection: Connection) -> bool:
    """Whether the server answered (a 408) or hung up on this connection."""
    try:
        await asyncio.wait_for(connection[0].read(1024), 0.01)
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


async def seconds_until_cut_off(connections: list[Connection], limit: float = 45.0) -> float:
    start = time.monotonic()
    pending = list(connections)
    while pending and time.monotonic() - start < limit:
        pending = [c for c in pending if not await cut_off(c)]
        await asyncio.sleep(0.25)
    return time.monotonic() - start if not pending else float("inf")


async def run(address: str, http_port: int | None, server: Any, rss_mb: Callable) -> list[dict]:
    from async_engine.client import AsyncClient

    async with AsyncClient(address) as client:
        alone = await latency(client)
        rows = [
            {
                "beside": "nothing",
                "4-token latency ms": round(1000 * alone, 1),
                "ratio": 1.0,
                "worst loop stall ms": None,
            }
        ]

        def row(name: str, took: float, stall: float) -> None:
            rows.append(
                {
                    "beside": name,
                    "4-token latency ms": round(1000 * took, 1),
                    "ratio": round(took / alone, 2),
                    "worst loop stall ms": round(1000 * stall, 1),
                }
            )

        kinds = list(grpc_kinds(client)) + (list(http_kinds(http_port)) if http_port else [])
        for name in kinds:
            row(name, *await beside(client, name, address, http_port))
        if http_port:
            for name, body in (("100 slowloris sockets", False), ("100 bodies never ending", True)):
                connections = await held_open(http_port, 100, body)
                stop = asyncio.Event()
                dripping = asyncio.create_task(trickle(connections, stop))
                stall_stop = asyncio.Event()
                probe = asyncio.create_task(worst_stall(client, stall_stop))
                took = await latency(client)
                stall_stop.set()
                stall = await probe
                gone = await seconds_until_cut_off(connections)
                stop.set()
                await dripping
                for _, writer in connections:
                    writer.close()
                row(f"{name} (all cut off after {gone:.0f} s)", took, stall)
    unread = await unread_streams(address, server, rss_mb)
    return rows + [unread]


UNREAD_CLIENT = """
import os, signal, sys
from async_engine.client import Client
client = Client(sys.argv[1])
streams = [client.generate([5, 6, 7, i + 8], max_tokens=4000, ignore_eos=True, logprobs=20)
           for i in range(24)]
for stream in streams:
    next(stream)  # the RPC is open and streaming; nothing more is ever read
print("opened", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


async def unread_streams(address: str, server: Any, rss_mb: Callable) -> dict:
    """The server's RSS while 24 streams with logprobs=20 are never read."""
    before = rss_mb(server.pid)
    proc = subprocess.Popen(
        [sys.executable, "-c", UNREAD_CLIENT, address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        peak = before
        for _ in range(40):
            await asyncio.sleep(0.25)
            peak = max(peak, rss_mb(server.pid))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    await asyncio.sleep(1.0)
    return {
        "beside": "24 never-read streams, logprobs=20: server RSS MB before / peak / after",
        "4-token latency ms": f"{before:.0f} / {peak:.0f} / {rss_mb(server.pid):.0f}",
        "ratio": None,
        "worst loop stall ms": None,
    }


async def _mix(address: str, http_port: int) -> None:
    """Every hostile kind in turn, forever: the background of a soak (see ``during``)."""
    from async_engine.client import AsyncClient

    async with AsyncClient(address) as client:
        kinds = {**grpc_kinds(client), **(http_kinds(http_port) if http_port else {})}
        print("started", flush=True)
        while True:
            for hostile in kinds.values():
                with contextlib.suppress(Exception):
                    await hostile()


def during(address: str, http_port: int | None) -> subprocess.Popen:
    """Start the hostile mix beside a soak; the caller kills it when the soak ends."""
    argv = [
        sys.executable,
        "-m",
        "async_engine.bench.hostile",
        "--mix",
        address,
        str(http_port or 0),
        "1",
    ]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL)


if __name__ == "__main__":  # one hostile kind (or --mix: all in turn) until killed
    kind, where, port, loops = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    asyncio.run(_mix(where, port) if kind == "--mix" else _hostile_loops(kind, where, port, loops))
