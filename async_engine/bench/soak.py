"""`async-engine bench soak`: long mixed load with cancels, then what it left behind.

Starts `async-engine serve` in a subprocess (the simulated device by default, so hours of
GPU-speed steps cost nothing), runs ``--concurrency`` clients for ``--minutes`` (random
prompts with shared prefixes, random lengths, ``--cancel-fraction`` of them dropped
mid-stream), samples the RSS of the server and its device process, and prints leaked KV
blocks, ghost requests and streams (engine state with no live RPC), RSS growth after
warm-up and errors by status code. ``--hostile`` runs every hostile kind of
``bench.hostile`` in turn all through the soak, then measures what each costs everyone else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import time
from collections import Counter
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="mixed-load duration (0: none)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--cancel-fraction", type=float, default=0.3)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--warmup-fraction", type=float, default=0.1, help="RSS growth counts after")
    p.add_argument("--hostile", action="store_true", help="also run the hostile-client checks")
    p.add_argument(
        "--device-kills",
        type=int,
        default=0,
        help="SIGKILL the device this many times, evenly spread, timing health",
    )
    p.add_argument("--workload-seed", type=int, default=0)
    p.set_defaults(device="sim", sim_preset="h200-135m")


def print_rows(rows: list[dict[str, Any]]) -> None:
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for row in rows:
        print("  ".join(str(row[k]).ljust(widths[k]) for k in keys))


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def device_pid(server_pid: int) -> int | None:
    """The server's child process (a restarted device is started from a worker thread,
    so every thread's children are looked at)."""
    children: list[str] = []
    try:
        for task in os.listdir(f"/proc/{server_pid}/task"):
            with open(f"/proc/{server_pid}/task/{task}/children") as f:
                children += f.read().split()
    except OSError:
        return None
    return int(children[-1]) if children else None


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    wanted = {
        "async_engine:engine_requests",
        "async_engine:engine_streams",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "async_engine:device_restarts_total",
    }
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


class Soak:
    def __init__(self, client: Any, args: argparse.Namespace, vocab: int) -> None:
        self.client, self.args = client, args
        self.rng = random.Random(args.workload_seed)
        self.prefixes = [[self.rng.randrange(100, vocab) for _ in range(160)] for _ in range(8)]
        self.vocab = vocab
        self.errors: Counter[str] = Counter()
        self.completed = self.cancelled = self.tokens = 0

    def _prompt(self) -> list[int]:
        rng = self.rng
        head = rng.choice(self.prefixes)[: rng.randrange(0, 160)] if rng.random() < 0.5 else []
        return head + [rng.randrange(100, self.vocab) for _ in range(rng.randrange(8, 300))]

    async def one(self) -> None:
        from async_engine.client import Chunk, EngineError

        rng, args = self.rng, self.args
        max_tokens = rng.randrange(4, args.max_output)
        cancel_after = rng.randrange(1, max_tokens) if rng.random() < args.cancel_fraction else 0
        stream = self.client.generate(
            self._prompt(), max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        seen = 0
        try:
            async with contextlib.aclosing(stream):
                async for event in stream:
                    if isinstance(event, Chunk):
                        seen += len(event.token_ids)
                        if cancel_after and seen >= cancel_after:
                            self.cancelled += 1
                            return
            self.completed += 1
        except EngineError as exc:
            self.errors[exc.code.name] += 1
        finally:
            self.tokens += seen

    async def run(self, seconds: float) -> None:
        stop_at = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < stop_at:
                await self.one()

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))


async def _soak(args: argparse.Namespace, address: str, metrics_port: int, server: Any) -> int:
    from async_engine.client import AsyncClient

    async with AsyncClient(address) as client:
        info = await client.model_info()
        seconds = args.minutes * 60
        soak = Soak(client, args, info.vocab_size)
        samples: list[tuple[float, dict[str, float]]] = []

        async def sample() -> None:
            start = time.monotonic()
            while True:
                device = device_pid(server.pid)  # a new one after each restart
                rss = {
                    "server": rss_mb(server.pid),
                    "device": rss_mb(device) if device else float("nan"),
                }
                samples.append((time.monotonic() - start, rss))
                await asyncio.sleep(max(1.0, seconds / 60))

        mix = None
        if args.hostile:  # the hostile kinds in turn, all through the soak
            from async_engine.bench import hostile

            mix = hostile.during(address, server.ready.get("http_port"))
        sampler = asyncio.create_task(sample())
        killer = asyncio.create_task(_kill_devices(client, args.device_kills, seconds, server))
        started = time.monotonic()
        try:
            await soak.run(seconds)
        finally:
            if mix is not None:
                mix.kill()
                mix.wait()
        elapsed = time.monotonic() - started
        sampler.cancel()
        kills = await killer
        await asyncio.sleep(1.0)  # the last cancels' blocks come back at the next step
        load = await client.load()
        state = scrape(metrics_port)
    warm = [rss for t, rss in samples if t >= args.warmup_fraction * seconds] or [samples[-1][1]]
    rows = [
        {"what": "requests completed / cancelled", "value": f"{soak.completed} / {soak.cancelled}"},
        {"what": "tokens streamed", "value": f"{soak.tokens} ({soak.tokens / elapsed:.0f}/s)"},
        {"what": "errors by code", "value": dict(soak.errors) or "none"},
        {"what": "leaked KV blocks (used at idle)", "value": load.total_blocks - load.free_blocks},
        {
            "what": "ghost requests (engine, idle)",
            "value": int(state.get("async_engine:engine_requests", -1)),
        },
        {
            "what": "ghost streams (engine, idle)",
            "value": int(state.get("async_engine:engine_streams", -1)),
        },
        {"what": "device restarts", "value": load.device_restarts},
    ]
    for i, (down, up) in enumerate(kills):
        rows.append(
            {
                "what": f"device kill {i + 1}: NOT_SERVING after / SERVING again after",
                "value": f"{1000 * down:.0f} ms / {up:.2f} s",
            }
        )
    for name in ("server", "device"):
        first, last = warm[0][name], warm[-1][name]
        peak = max(s[name] for _, s in samples)
        rows.append(
            {
                "what": f"{name} RSS after warm-up -> end (peak), MB",
                "value": f"{first:.0f} -> {last:.0f} ({peak:.0f}), "
                f"{100 * (last - first) / first:+.1f} %",
            }
        )
    print(
        f"\nsoak: {elapsed / 60:.1f} min, {args.concurrency} concurrent, "
        f"{100 * args.cancel_fraction:.0f} % cancelled"
    )
    print_rows(rows)
    return 1 if any(row["value"] for row in rows[3:6]) else 0


async def _kill_devices(client: Any, count: int, seconds: float, server: Any) -> list:
    """SIGKILL the device ``count`` times; (seconds to NOT_SERVING, to SERVING again)."""
    timings: list[tuple[float, float]] = []
    start = time.monotonic()
    for i in range(count):
        await asyncio.sleep(max(0.0, start + (i + 1) * seconds / (count + 1) - time.monotonic()))
        pid = device_pid(server.pid)
        if pid is None:
            break
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while await client.serving() and time.monotonic() - killed < 30:
            await asyncio.sleep(0.005)
        down = time.monotonic() - killed
        while not await client.serving() and time.monotonic() - killed < 120:
            await asyncio.sleep(0.02)
        up = time.monotonic() - killed
        timings.append((down, up))
    return timings


async def _hostile(address: str, http_port: int | None, server: Any) -> None:
    from async_engine.bench import hostile

    rows = await hostile.run(address, http_port, server, rss_mb)
    print(
        "\nhostile neighbours (2 clients in a loop each); 4-token latency median of 15, "
        "worst event-loop stall from GetLoad polled every 50 ms:"
    )
    print_rows(rows)


def cmd_soak(args: argparse.Namespace) -> int:
    from async_engine.bench.server_process import spawn_server

    args.backend = "grpc"
    args.http = args.hostile  # the hostile checks speak HTTP too
    server, address, metrics_port = spawn_server(args)
    try:
        status = 0
        if args.minutes > 0:
            status = asyncio.run(_soak(args, address, metrics_port, server))
        if args.hostile:
            asyncio.run(_hostile(address, server.ready.get("http_port"), server))
        return status
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
