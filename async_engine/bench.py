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


def steady_decode_idle(plans: list[Any], spans: list[tuple[int, float, float, bool]]) -> float:
    """Device idle fraction over steps where every request decodes one token."""
    decode = {p.step_id for p in plans if p.query_lens and max(p.query_lens) == 1}
    busy = idle = 0.0
    prev: tuple[int, float, float, bool] | None = None
    for span in spans:
        step, start, end, after_idle = span
        if step in decode and prev is not None and prev[0] in decode:
            busy += end - start
            if not after_idle:
                idle += max(0.0, start - prev[2])
        prev = span
    return idle / (busy + idle) if busy + idle > 0 else float("nan")


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
            "steady_decode_idle": steady_decode_idle(plans, list(engine.timeline.spans)),
            "wasted_tokens": engine.scheduler.wasted_tokens,
        }
        if roofline:
            seconds = engine.device.replay(plans)
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


def cmd_offline(args: argparse.Namespace) -> int:
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
          f"tokens, {work.max_tokens} new tokens each, greedy, ignore_eos; dtype {dtype}")  # fmt: skip
    on = run_engine(options, prompts, work.max_tokens, overlap=True, roofline=True)
    off = run_engine(options, prompts, work.max_tokens, overlap=False, roofline=False)
    hf = None if args.skip_hf else run_hf(str(folder), dtype, prompts, work.max_tokens)
    rows = [
        ("engine, overlap on", on["tokens_per_s"]),
        ("engine, overlap off", off["tokens_per_s"]),
        ("forward-only roofline", on["roofline_tokens_per_s"]),
    ]
    if hf is not None:
        rows.append(("HF generate_batch", hf["tokens_per_s"]))
    print(f"{'run':<24}{'tokens/s':>10}")
    for name, tps in rows:
        print(f"{name:<24}{tps:>10.1f}")
    print(f"overlap on / off:          {on['tokens_per_s'] / off['tokens_per_s']:.2f}x")
    print(f"overlap on / roofline:     {on['tokens_per_s'] / on['roofline_tokens_per_s']:.1%}")
    if hf is not None:
        print(f"overlap on / HF:           {on['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    print(f"steady-decode idle, on:    {on['steady_decode_idle']:.1%}")
    print(f"steady-decode idle, off:   {off['steady_decode_idle']:.1%}")
    print(f"wasted tokens, on:         {on['wasted_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overlap_on": on, "overlap_off": off, "hf": hf}, f, indent=2)
    return 0


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
    offline.add_argument("--skip-hf", action="store_true")
    offline.add_argument("--json", default=None, help="write the figures to this file")
    offline.set_defaults(func=cmd_offline)
    from async_engine import bench_serve

    bench_serve.add_parser(kinds, engine_args)
