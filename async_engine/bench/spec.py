"""`async-engine bench spec`: speculation off against each drafter, at each batch size.

Two workloads: an agent-like one (tool loops whose answers quote the conversation,
``bench/agent_workload.py``; on the simulated device, text that quotes itself at
``--agent-repeat``) and the offline bench's plain one (random prompts: nothing to draft).
Each method gets one engine, warmed up; at each batch size every engine runs in turn: ``batch``
requests at a time (a new one starts as one ends), overlap on, ``--rounds`` times over with
new prompts each round (the methods' order turning round to round), and each method's
rounds are pooled. All figures come from one run and are printed as ratios to speculation
off; on a noisy machine the spread of the rounds' ratios says how far to trust them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from async_engine.bench.agent_workload import conversations
from async_engine.bench.cpu_info import cpu_info, describe
from async_engine.bench.load import percentiles
from async_engine.bench.spec_table import agreement, print_tables
from async_engine.core.workload import Workload
from sampler.params import SamplingParams

RAW = ("outputs", "prompts", "gaps", "tpots")  # kept out of --json
SPEC_KEYS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


async def run_batch(
    engine: Any, prompts: list[list[int]], params: SamplingParams, batch: int
) -> dict:
    """Every prompt through ``engine``, ``batch`` at a time; the figures of the run."""
    gate = asyncio.Semaphore(batch)
    before = engine.stats().as_dict()
    engine.timeline.reset(window=1_000_000)

    async def one(prompt: list[int]) -> Any:
        async with gate:
            req = engine.add_request(prompt, params, detokenize=False)
            try:
                async for _ in engine.stream(req):
                    pass
            finally:
                engine.release(req)
            return req

    start = time.perf_counter()
    reqs = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    after = engine.stats().as_dict()
    tokens = sum(len(r.output_ids) for r in reqs)
    gaps, tpot = [], []
    for r in reqs:
        times = sorted(set(r.token_times))  # tokens of one step arrive together: one chunk
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
        if len(r.output_ids) > 1 and r.finished_time and r.first_token_time:
            tpot.append((r.finished_time - r.first_token_time) / (len(r.output_ids) - 1))
    delta = {k: after[k] - before[k] for k in SPEC_KEYS}
    return pooled(
        [
            {
                "tokens": tokens,
                "seconds": wall,
                "gaps": gaps,
                "tpots": tpot,
                "spec": delta,
                "device_idle": engine.timeline.idle_fraction(),
                "outputs": [list(r.output_ids) for r in reqs],
                "prompts": prompts,
            }
        ]
    )


def pooled(rounds: list[dict]) -> dict:
    """One method's figures over its rounds at one batch size: tokens over seconds, every
    round's latencies and drafts together, and each round's tokens/s."""
    tokens = sum(r["tokens"] for r in rounds)
    seconds = sum(r["seconds"] for r in rounds)
    spec = {k: sum(r["spec"][k] for r in rounds) for k in SPEC_KEYS}
    gaps = [g for r in rounds for g in r["gaps"]]
    tpots = [t for r in rounds for t in r["tpots"]]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "round_tokens_per_s": [r["tokens"] / r["seconds"] for r in rounds],
        "gaps": gaps,
        "tpots": tpots,
        "spec": spec,
        "itl_ms": _percentiles(gaps),
        "tpot_ms": _percentiles(tpots),
        "acceptance": spec["spec_num_accepted_tokens"] / max(1, spec["spec_num_draft_tokens"]),
        "accepted_length": 1 + spec["spec_num_accepted_tokens"] / max(1, spec["spec_num_drafts"]),
        "device_idle": sum(r["device_idle"] * r["seconds"] for r in rounds) / seconds,
        "outputs": [o for r in rounds for o in r["outputs"]],
        "prompts": [p for r in rounds for p in r["prompts"]],
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    pick = percentiles([v * 1e3 for v in values])
    return {"p50": pick["p50"], "p95": pick["p95"]}


async def run_methods(
    options: dict[str, dict[str, Any]],
    prompts: list[list[int]],
    params: SamplingParams,
    batches: list[int],
    min_requests: int,
    rounds: int = 1,
) -> dict[str, dict[int, dict]]:
    """Each method's engine (``options`` by method), all started first, then every batch
    size run by each in turn: on a noisy machine a slow minute falls on every method alike,
    not on the one whose turn it was."""
    from async_engine.core.engine import AsyncEngine

    engines: dict[str, AsyncEngine] = {}
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for method, engine_options in options.items():
            engines[method] = AsyncEngine(**engine_options)
            await run_batch(engines[method], prompts[-2:], warm, 2)
        # Prompts no earlier batch size ran: a drafter that remembers finished requests
        # (suffix) must not find this run's answers there.
        out: dict[str, dict[int, dict]] = {method: {} for method in options}
        at = 0
        for batch in batches:
            count = max(min_requests, 2 * batch)
            runs: dict[str, list[dict]] = {method: [] for method in options}
            for turn in range(rounds):
                order = list(engines)
                order = order[turn % len(order) :] + order[: turn % len(order)]
                for method in order:
                    runs[method].append(
                        await run_batch(engines[method], prompts[at : at + count], params, batch)
                    )
                at += count
            for method, done in runs.items():
                out[method][batch] = pooled(done)
        return out
    finally:
        for engine in engines.values():
            await engine.aclose()


async def first_difference_margins(
    options: dict[str, Any], differences: list[tuple[list[int], int]]
) -> list[float]:
    """The top-2 logprob margin of speculation-off decoding at each ``(prompt, index)`` where
    a method's greedy tokens first differ from off's: near 0, a rounding tie."""
    from async_engine.core.engine import AsyncEngine

    engine = AsyncEngine(**{**options, "speculative_config": None})
    try:
        margins = []
        for prompt, index in differences:
            params = SamplingParams(
                temperature=0.0, max_tokens=index + 1, ignore_eos=True, logprobs=2
            )
            req = engine.add_request(prompt, params, detokenize=False)
            try:
                async for _ in engine.stream(req):
                    pass
            finally:
                engine.release(req)
            top = req.output_top_logprobs[index]
            margins.append(top[0][1] - top[1][1] if len(top) > 1 else float("inf"))
        return margins
    finally:
        await engine.aclose()


def workload_prompts(
    name: str, options: dict[str, Any], count: int, seed: int, history: int = 0
) -> list[list[int]]:
    from async_engine.core.tokenizer import Tokenizer
    from async_engine.model import load_model_config, resolve_model

    folder = resolve_model(options["model"])
    if name == "plain":
        return Workload(count, 20, 300, 64, seed).prompts(load_model_config(folder).vocab_size)
    tokenizer = Tokenizer(folder)
    return [tokenizer.apply_chat_template(c) for c in conversations(count, seed, history)]


def cmd_spec(args: argparse.Namespace) -> int:
    from async_engine.cli.options import engine_options
    from async_engine.core.config import EngineConfig

    if args.rounds < 1:
        raise SystemExit(f"--rounds: give 1 or more runs a batch size, got {args.rounds}")
    if args.agent_history < 0:
        raise SystemExit(f"--agent-history: give 0 or more exchanges, got {args.agent_history}")
    options = engine_options(args)
    options["speculative_config"] = None
    config = EngineConfig(**options)
    options["dtype"] = dtype = config.resolved_dtype()
    sim = config.resolved_device() == "sim"
    batches = [int(b) for b in args.batches.split(",")]
    methods = ["off", *[m for m in args.methods.split(",") if m]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(describe(cpu_info(config.resolved_device())))
    print(
        f"dtype {dtype}; batches {batches}; {args.max_tokens} new tokens each, greedy; "
        f"k = {args.num_speculative_tokens}; at least {args.min_requests} requests a batch size"
        f" in each of {args.rounds} round(s)"
    )
    results: dict[str, dict[str, dict[int, dict]]] = {}
    margins: dict[str, dict[str, list[float]]] = {}
    for workload in args.workloads.split(","):
        needed = args.rounds * sum(max(args.min_requests, 2 * b) for b in batches) + 2
        prompts = workload_prompts(
            workload, options, needed, args.workload_seed, args.agent_history
        )
        by_method = {}
        for method in methods:
            run_options = dict(options)
            if sim and workload == "agent":
                run_options["sim_repeat"] = args.agent_repeat
            if method != "off":
                speculative = {
                    "method": method,
                    "num_speculative_tokens": args.num_speculative_tokens,
                }
                if method == "draft_model":
                    speculative["model"] = args.draft_model
                run_options["speculative_config"] = speculative
            by_method[method] = run_options
        per_method = asyncio.run(
            run_methods(by_method, prompts, params, batches, args.min_requests, args.rounds)
        )
        results[workload] = per_method
        if not sim:
            margins[workload] = {
                method: asyncio.run(first_difference_margins(options, agree["differences"]))
                for method, agree in agreement(per_method).items()
                if agree["differences"]
            }
    print_tables(results, float32=dtype == "float32", margins=margins)
    if args.json:
        slim = {
            w: {m: {b: {k: v for k, v in r.items() if k not in RAW}
                    for b, r in runs.items()}
                for m, runs in per.items()}
            for w, per in results.items()
        }  # fmt: skip
        agree = {
            w: {m: {k: v for k, v in a.items() if k != "differences"}
                for m, a in agreement(per).items()}
            for w, per in results.items()
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"runs": slim, "agreement": agree, "margins": margins}, f, indent=2)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="ngram,suffix", help="drafters to compare with off")
    p.add_argument("--batches", default="1,4,16,64,256", help="requests at a time")
    p.add_argument("--workloads", default="agent,plain")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=8, help="requests per batch size (>= 2x)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every method at each batch size, pooled (new prompts each round)",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-model", default=None, help="the draft_model method's model")
    p.add_argument(
        "--agent-repeat",
        type=float,
        default=0.9,
        help="sim device, agent workload: share of output tokens that quote earlier text"
        " (0.9: agent turns repeat over 90%% of the turn before)",
    )
    p.add_argument(
        "--agent-history",
        type=int,
        default=0,
        help="agent workload: earlier tool exchanges before each loop's last turn (~150 tokens"
        " each: 20 makes prompts of ~3,000 tokens, an agent's long context), shared by a"
        " session's 4 loops in a row",
    )
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")
