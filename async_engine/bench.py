"""`async-engine bench offline`: engine (overlap on/off) vs HF continuous batching vs roofline.

All figures come from one run on the same model, dtype and workload, and are printed as
ratios so that a noisy machine still gives a fair comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from sampler.params import SamplingParams


@dataclass(slots=True)
class Workload:
    num_requests: int = 32
    min_prompt: int = 20
    max_prompt: int = 300
    max_tokens: int = 64
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        # Skip the first ids: many tokenizers keep special tokens there.
        return [
            [
                rng.randrange(100, vocab_size)
                for _ in range(rng.randint(self.min_prompt, self.max_prompt))
            ]
            for _ in range(self.num_requests)
        ]


def decode_steps(plans: list[Any]) -> set[int]:
    """Steps where every request decodes one token: the "steady decode" of the reports."""
    return {p.step_id for p in plans if p.query_lens and max(p.query_lens) == 1}


def run_engine(options: dict[str, Any], prompts: list[list[int]], max_tokens: int, overlap: bool,
               roofline: bool) -> dict[str, float]:  # fmt: skip
    from async_engine.llm import LLM
    from async_engine.stats import DeviceTimeline

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(**{**options, "overlap": overlap}) as llm:
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        engine = llm.engine
        engine.timeline = DeviceTimeline(window=1_000_000)
        engine.recorded_plans = []
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        plans, engine.recorded_plans = engine.recorded_plans, None
        tokens = sum(len(o.token_ids) for o in outs)
        result = {
            "tokens": tokens,
            "seconds": wall,
            "tokens_per_s": tokens / wall,
            "steps": len(plans),
            "idle_fraction": engine.timeline.idle_fraction(),
            "steady_decode_idle": engine.timeline.idle_fraction(only=decode_steps(plans)),
            "wasted_tokens": engine.scheduler.wasted_tokens,
        }
        if roofline:
            seconds = llm._runner.run(engine.replay(plans))
            result["roofline_seconds"] = seconds
            result["roofline_tokens_per_s"] = tokens / seconds
    return result


def run_hf(folder: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.eval()
    config = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0,
    )  # fmt: skip
    model.generate_batch(inputs=[prompts[0][:16]], generation_config=config, progress_bar=False)
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def _mean(runs: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in runs) / len(runs)


def compare_modes(
    options: dict[str, Any], prompts: list[list[int]], max_tokens: int, rounds: int
) -> dict[str, Any]:
    """Overlap on and off, interleaved round by round so that drift hits both alike."""
    on: list[dict[str, float]] = []
    off: list[dict[str, float]] = []
    for i in range(rounds):
        on.append(run_engine(options, prompts, max_tokens, overlap=True, roofline=i == 0))
        off.append(run_engine(options, prompts, max_tokens, overlap=False, roofline=False))
    return {
        "on_tokens_per_s": _mean(on, "tokens_per_s"),
        "off_tokens_per_s": _mean(off, "tokens_per_s"),
        "roofline_tokens_per_s": on[0]["roofline_tokens_per_s"],
        "on_steady_decode_idle": _mean(on, "steady_decode_idle"),
        "off_steady_decode_idle": _mean(off, "steady_decode_idle"),
        "on_wasted_tokens": on[0]["wasted_tokens"],
        "runs_on": on,
        "runs_off": off,
    }


def cmd_offline(args: argparse.Namespace) -> int:
    import os

    from async_engine.cli import engine_options
    from async_engine.config import EngineConfig
    from async_engine.model import load_model_config, resolve_model

    options = engine_options(args)
    options.pop("overlap")
    config = EngineConfig(**options)
    dtype = config.resolved_dtype()
    options["dtype"] = dtype
    folder = resolve_model(config.model)
    vocab = load_model_config(folder).vocab_size
    work = Workload(args.requests, args.min_prompt, args.max_prompt, args.max_tokens, args.seed)
    prompts = work.prompts(vocab)
    print(f"workload: {work.num_requests} requests, prompts {work.min_prompt}..{work.max_prompt} "
          f"tokens, {work.max_tokens} new tokens each, greedy, ignore_eos; dtype {dtype}; "
          f"{args.rounds} interleaved rounds per mode")  # fmt: skip
    cores = os.cpu_count() or 1
    thread_counts = [config.resolved_device_threads()]
    if args.device_threads is None and cores not in thread_counts:
        thread_counts.append(cores)  # also show the device with every core
    results: dict[str, Any] = {}
    for threads in thread_counts:
        results[f"device_threads={threads}"] = compare_modes(
            {**options, "device_threads": threads}, prompts, work.max_tokens, args.rounds
        )
    hf = None if args.skip_hf else run_hf(str(folder), dtype, prompts, work.max_tokens)
    print_table(results, hf)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": results, "hf": hf}, f, indent=2)
    return 0


def print_table(results: dict[str, Any], hf: dict[str, float] | None) -> None:
    cols = list(results)
    width = max(24, *(len(c) + 2 for c in cols))
    print(f"{'':<28}" + "".join(f"{c:>{width}}" for c in cols))

    def row(name: str, fmt: str, values: list[float]) -> None:
        print(f"{name:<28}" + "".join(f"{format(v, fmt):>{width}}" for v in values))

    get = [results[c] for c in cols]
    row("tokens/s, overlap on", ".1f", [r["on_tokens_per_s"] for r in get])
    row("tokens/s, overlap off", ".1f", [r["off_tokens_per_s"] for r in get])
    row("tokens/s, roofline", ".1f", [r["roofline_tokens_per_s"] for r in get])
    row("overlap on / off", ".2f", [r["on_tokens_per_s"] / r["off_tokens_per_s"] for r in get])
    row("overlap on / roofline", ".1%",
        [r["on_tokens_per_s"] / r["roofline_tokens_per_s"] for r in get])  # fmt: skip
    if hf is not None:
        row("overlap on / HF", ".2f", [r["on_tokens_per_s"] / hf["tokens_per_s"] for r in get])
    row("steady-decode idle, on", ".2%", [r["on_steady_decode_idle"] for r in get])
    row("steady-decode idle, off", ".2%", [r["off_steady_decode_idle"] for r in get])
    row("wasted tokens, on", "d", [r["on_wasted_tokens"] for r in get])
    if hf is not None:
        print(f"HF transformers generate_batch: {hf['tokens_per_s']:.1f} tokens/s")


def add_parser(sub: Any, engine_args: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (not tests)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    offline = kinds.add_parser("offline", help="throughput vs HF, overlap on/off, roofline")
    engine_args(offline)
    offline.add_argument("--requests", type=int, default=32)
    offline.add_argument("--min-prompt", type=int, default=20)
    offline.add_argument("--max-prompt", type=int, default=300)
    offline.add_argument("--max-tokens", type=int, default=64)
    offline.add_argument("--seed", type=int, default=0)
    offline.add_argument("--rounds", type=int, default=2, help="interleaved runs per mode")
    offline.add_argument("--skip-hf", action="store_true")
    offline.add_argument("--json", default=None, help="write the figures to this file")
    offline.set_defaults(func=cmd_offline)
    from async_engine import bench_serve

    bench_serve.add_parser(kinds, engine_args)
