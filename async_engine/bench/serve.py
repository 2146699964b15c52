"""`async-engine bench serve`: online load over gRPC (and the same load in-process).

Starts `async-engine serve` in a subprocess unless --target names a running server, sends
Poisson (or burst) arrivals at each rate, and reports TTFT/TPOT/ITL/E2E percentiles,
throughput, goodput under the SLOs and abort lag; --find-capacity searches the highest
rate whose p95 TTFT and p95 ITL hold; --compare-inprocess runs the same load against an
AsyncEngine in this process and prints the gRPC/in-process token-throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from async_engine.bench.load import (
    LoadSpec,
    RequestRecord,
    RequestSpec,
    Slo,
    make_requests,
    summarize,
)
from async_engine.bench.rate_sweep import sweep
from async_engine.bench.report import print_table, write_plot
from async_engine.bench.server_metrics import idle_delta, lag_delta, phase_delta, scrape
from async_engine.bench.server_process import spawn_server
from sampler.params import SamplingParams

WARMUP = LoadSpec(num_requests=2, min_output=2, max_output=4)
Sender = Callable[[RequestSpec, RequestRecord], Awaitable[None]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", default=None, help="host:port of a running server (default: start one)"
    )
    p.add_argument(
        "--backend",
        choices=["grpc", "openai"],
        default="grpc",
        help="openai: drive any OpenAI-compatible server's /v1/completions",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=49152,
        help="openai backend: vocabulary of the random prompts (default model's)",
    )
    p.add_argument("--auth-token", default=None)
    p.add_argument("--rates", default="1,2,4", help="request rates in req/s, comma separated")
    p.add_argument("--burst", action="store_true", help="send every request at t=0")
    p.add_argument("--requests", type=int, default=64, help="requests per rate")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--cancel-fraction", type=float, default=0.0)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--find-capacity", action="store_true")
    p.add_argument("--max-rate", type=float, default=64.0)
    p.add_argument("--search-steps", type=int, default=3)
    p.add_argument("--compare-inprocess", action="store_true")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random load")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--plot", default=None, help="write a PNG of latency vs load")
    p.add_argument(
        "--tenants",
        default=None,
        help="per-tenant loads, e.g. 'a:burst=64,prompt=300,output=128;"
        "b:rate=1,duration=30,prompt=50,output=32' (see bench/tenants.py)",
    )
    p.add_argument(
        "--policies",
        default="fair,fcfs",
        help="with --tenants: scheduling policies to run, one server each",
    )
    p.add_argument(
        "--alone", default=None, help="with --tenants: tenants to also run alone (their baseline)"
    )


# ------------------------------------------------------------------ drivers
async def run_load(send: Sender, requests: list[RequestSpec]) -> tuple[list[RequestRecord], float]:
    records = [RequestRecord() for _ in requests]
    start = time.perf_counter()

    async def one(spec: RequestSpec, rec: RequestRecord) -> None:
        delay = start + spec.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec.sent = time.perf_counter()
        try:
            await send(spec, rec)
        except Exception as exc:  # counted, never fatal: the run goes on
            rec.error = repr(exc)

    await asyncio.gather(*(one(s, r) for s, r in zip(requests, records, strict=True)))
    return records, time.perf_counter() - start


def on_tokens(spec: RequestSpec, rec: RequestRecord, count: int) -> bool:
    """Record a streamed message; True when the client should now abandon the stream."""
    now = time.perf_counter()
    rec.chunk_times.append(now)
    if rec.first_token is None:
        rec.first_token = now
    rec.tokens += count
    return spec.cancel_after is not None and rec.tokens >= spec.cancel_after


def grpc_sender(client: Any) -> Sender:
    from async_engine.client import Chunk, Finished

    async def send(spec: RequestSpec, rec: RequestRecord) -> None:
        stream = client.generate(
            spec.prompt, max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True
        )
        async with contextlib.aclosing(stream):
            async for event in stream:
                if isinstance(event, Chunk) and event.token_ids:
                    if event.offset != rec.tokens:  # the stream's order, checked on every chunk
                        raise RuntimeError(f"chunk at offset {event.offset}, {rec.tokens} seen")
                    if on_tokens(spec, rec, len(event.token_ids)):
                        rec.cancelled = True
                        break  # closing the stream cancels the RPC
                elif isinstance(event, Finished):
                    rec.end = time.perf_counter()
                    if event.completion_tokens != rec.tokens:
                        raise RuntimeError(
                            f"usage says {event.completion_tokens} tokens, {rec.tokens} streamed"
                        )
        if rec.cancelled:
            rec.end = time.perf_counter()
        elif rec.end is None:
            raise RuntimeError("the stream ended without Finished")

    return send


def engine_sender(engine: Any, cancelled: list[tuple[Any, RequestRecord]]) -> Sender:
    async def send(spec: RequestSpec, rec: RequestRecord) -> None:
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
        req = engine.add_request(spec.prompt, params)
        try:
            async for delta in engine.stream(req):
                if delta.token_ids and on_tokens(spec, rec, len(delta.token_ids)):
                    rec.cancelled = True
                    break
        finally:
            engine.release(req)
        rec.end = time.perf_counter()
        if rec.cancelled:
            cancelled.append((req, rec))

    return send


# ----------------------------------------------------------------- targets
async def grpc_phase(
    args: argparse.Namespace, spec: LoadSpec, slo: Slo, target: str, metrics_port: int | None
) -> dict[str, Any]:
    from async_engine.client import AsyncClient

    async with AsyncClient(target, token=args.auth_token) as client:
        vocab = (await client.model_info()).vocab_size
        send = grpc_sender(client)
        await run_load(send, make_requests(WARMUP, 1.0, vocab))

        async def run_rate(rate: float) -> dict[str, Any]:
            before = scrape(metrics_port)
            records, duration = await run_load(send, make_requests(spec, rate, vocab))
            await asyncio.sleep(0.6)  # the server refreshes its metrics every 0.25 s
            after = scrape(metrics_port)
            summary = summarize(records, duration, slo)
            summary["abort_lag_s"] = lag_delta(before, after)
            summary["server_device_idle"] = idle_delta(before, after)
            summary["server_phase_ms_per_step"] = phase_delta(before, after)
            return summary

        return await sweep(run_rate, _rates(args), args, slo)


async def openai_phase(
    args: argparse.Namespace, spec: LoadSpec, slo: Slo, target: str, metrics_port: int | None
) -> dict[str, Any]:
    from async_engine.bench.openai_load import HttpTarget, openai_sender, served_model

    http = HttpTarget(target, args.auth_token)
    send = openai_sender(http, await served_model(http), on_tokens)
    await run_load(send, make_requests(WARMUP, 1.0, args.vocab_size))

    async def run_rate(rate: float) -> dict[str, Any]:
        before = scrape(metrics_port)
        records, duration = await run_load(send, make_requests(spec, rate, args.vocab_size))
        await asyncio.sleep(0.6 if metrics_port else 0.0)
        after = scrape(metrics_port)
        summary = summarize(records, duration, slo)
        summary["server_device_idle"] = idle_delta(before, after)
        summary["server_phase_ms_per_step"] = phase_delta(before, after)
        return summary

    return await sweep(run_rate, _rates(args), args, slo)


async def inprocess_phase(
    engine: Any, args: argparse.Namespace, spec: LoadSpec, slo: Slo
) -> dict[str, Any]:
    cancelled: list[tuple[Any, RequestRecord]] = []
    send = engine_sender(engine, cancelled)
    vocab = engine.model_config.vocab_size
    await run_load(send, make_requests(WARMUP, 1.0, vocab))

    async def run_rate(rate: float) -> dict[str, Any]:
        cancelled.clear()
        records, duration = await run_load(send, make_requests(spec, rate, vocab))
        await asyncio.sleep(0.1)  # blocks free on the step after an abort
        for req, rec in cancelled:
            if req.abort_time is not None and req.released_time is not None:
                rec.abort_lag_s = req.released_time - req.abort_time
        return summarize(records, duration, slo)

    try:
        return await sweep(run_rate, _rates(args), args, slo)
    finally:
        await engine.aclose()


def _rates(args: argparse.Namespace) -> list[float]:
    return [float(r) for r in args.rates.split(",") if r.strip()]


def cmd_serve_bench(args: argparse.Namespace) -> int:
    import uvloop

    if args.tenants:
        from async_engine.bench.tenants import cmd_tenants

        return cmd_tenants(args)

    spec = LoadSpec(
        args.requests,
        args.min_prompt,
        args.max_prompt,
        args.min_output,
        args.max_output,
        args.cancel_fraction,
        args.burst,
        args.workload_seed,
    )
    ms = 1e-3
    slo = Slo(
        args.slo_ttft_ms * ms,
        args.slo_itl_ms * ms,
        args.slo_tpot_ms and args.slo_tpot_ms * ms,
        args.slo_e2e_ms and args.slo_e2e_ms * ms,
    )
    out: dict[str, Any] = {"load": spec.__repr__(), "slo": slo.__repr__()}
    proc = None
    try:
        if args.target is None:
            proc, target, metrics_port = spawn_server(args)
        else:
            target, metrics_port = args.target, None
        phase = openai_phase if args.backend == "openai" else grpc_phase
        out[args.backend] = uvloop.run(phase(args, spec, slo, target, metrics_port))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print_table("OpenAI HTTP" if args.backend == "openai" else "gRPC", out[args.backend])
    if args.compare_inprocess:
        from async_engine.cli.options import engine_options
        from async_engine.core.engine import AsyncEngine

        engine = AsyncEngine(**engine_options(args))  # built before the loop: it blocks
        out["inprocess"] = uvloop.run(inprocess_phase(engine, args, spec, slo))
        print_table("in-process AsyncEngine", out["inprocess"])
        out[f"{args.backend}_vs_inprocess"] = ratios = {}
        for rate, summary in out[args.backend]["runs"].items():
            local = out["inprocess"]["runs"].get(rate)
            if local is not None:
                ratios[rate] = summary["output_tokens_per_s"] / local["output_tokens_per_s"]
                print(f"rate {rate:g}: {args.backend} tokens/s = {ratios[rate]:.1%} of in-process")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    if args.plot:
        write_plot(out, args.plot, slo)
    return 0
