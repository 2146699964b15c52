"""`async-engine bench offline`: engine (overlap on/off) vs HF continuous batching vs roofline.

All figures come from one run on the same model, dtype and workload, and are printed as
ratios so that a noisy machine still gives a fair comparison.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

from async_engine.bench.cpu_info import cpu_info, describe
from async_engine.bench.offline_table import print_table
from async_engine.bench.peers.run import run_peers
from async_engine.core.workload import Workload
from sampler.params import SamplingParams

if TYPE_CHECKING:
    from async_engine.core.observer import StepObserver
    from streams.plan import StepPlan, StepResult


class PlanRecorder:
    """A StepObserver keeping each completed step's plan, in launch order: the roofline's input.

    It forwards to the observer it replaced, so a tracer attached before still sees every step.
    """

    def __init__(self, inner: StepObserver | None = None) -> None:
        self.inner = inner
        self.plans: list[StepPlan] = []
        self.control_s: dict[int, float] = {}  # per step: schedule, launch, apply, stream

    def on_phase(self, name: str, step_id: int, start: float, end: float) -> None:
        if name != "wait":
            self.control_s[step_id] = self.control_s.get(step_id, 0.0) + end - start
        if self.inner is not None:
            self.inner.on_phase(name, step_id, start, end)

    def on_device(self, plan: StepPlan, result: StepResult) -> None:
        self.plans.append(plan)
        if self.inner is not None:
            self.inner.on_device(plan, result)


def decode_steps(plans: list[Any]) -> set[int]:
    """Steps where every request decodes one token: the "steady decode" of the reports."""
    return {p.step_id for p in plans if len(p.query_lens) and p.query_lens.max() == 1}


def decode_control_ms(plans: list[Any], control_s: dict[int, float]) -> float:
    """The control plane's mean ms per decode step (its own schedule, launch, apply and
    stream), at the run's largest decode batch."""
    decode = [p for p in plans if len(p.query_lens) and p.query_lens.max() == 1]
    if not decode:
        return float("nan")
    batch = max(p.batch_size for p in decode)
    times = [control_s.get(p.step_id, 0.0) for p in decode if p.batch_size == batch]
    return 1e3 * sum(times) / len(times)


def full_batch_decode_ms(plans: list[Any], spans: Any) -> tuple[float, int]:
    """Median device ms of the decode steps at the run's largest batch, and that batch."""
    decode = [p for p in plans if len(p.query_lens) and p.query_lens.max() == 1]
    if not decode:
        return float("nan"), 0
    batch = max(p.batch_size for p in decode)
    wanted = {p.step_id for p in decode if p.batch_size == batch}
    times = sorted(end - start for step, start, end, _ in spans if step in wanted)
    return (1e3 * times[len(times) // 2] if times else float("nan")), batch


def run_engine(
    options: dict[str, Any],
    prompts: list[list[int]],
    max_tokens: int,
    overlap: bool,
    roofline: bool,
) -> dict[str, float]:
    from async_engine.core.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(**{**options, "overlap": overlap}) as llm:
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        engine = llm.engine
        engine.timeline.reset(window=1_000_000)
        engine.phase_clock.reset()
        engine.observer = recorder = PlanRecorder(engine.observer)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        engine.observer, plans = recorder.inner, list(recorder.plans)  # a late step may append
        tokens = sum(len(o.token_ids) for o in outs)
        result = {
            "tokens": tokens,
            "seconds": wall,
            "tokens_per_s": tokens / wall,
            "steps": len(plans),
            "idle_fraction": engine.timeline.idle_fraction(),
            "steady_decode_idle": engine.timeline.idle_fraction(only=decode_steps(plans)),
            "wasted_tokens": engine.scheduler.wasted_tokens,
            "decode_control_ms": decode_control_ms(plans, recorder.control_s),
            "full_decode": full_batch_decode_ms(plans, engine.timeline.spans),
            # Control-plane time per step, by phase ("wait" is time blocked on the device).
            "phase_ms_per_step": {
                name: 1e3 * seconds / max(1, len(plans))
                for name, seconds in engine.phase_clock.seconds.items()
            },
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
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
    )
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
        "on_decode_control_ms": _mean(on, "decode_control_ms"),
        "full_decode_ms": on[0]["full_decode"][0],
        "full_decode_batch": on[0]["full_decode"][1],
        "on_idle": _mean(on, "idle_fraction"),
        "off_idle": _mean(off, "idle_fraction"),
        "on_ms_per_step": _mean(on, "seconds") * 1e3 / on[0]["steps"],
        "off_ms_per_step": _mean(off, "seconds") * 1e3 / off[0]["steps"],
        "on_phase_ms": on[0]["phase_ms_per_step"],
        "off_phase_ms": off[0]["phase_ms_per_step"],
        "runs_on": on,
        "runs_off": off,
    }


def cmd_offline(args: argparse.Namespace) -> int:
    import os

    from async_engine.cli.options import engine_options
    from async_engine.core.config import EngineConfig
    from async_engine.model import load_model_config, resolve_model

    options = engine_options(args)
    options.pop("overlap")
    config = EngineConfig(**options)
    dtype = config.resolved_dtype()
    options["dtype"] = dtype
    folder = resolve_model(config.model)
    vocab = load_model_config(folder).vocab_size
    work = Workload(
        args.requests, args.min_prompt, args.max_prompt, args.max_tokens, args.workload_seed
    )
    prompts = work.prompts(vocab)
    cpu = cpu_info(config.resolved_device())
    print(describe(cpu))
    print(
        f"workload: {work.num_requests} requests, prompts {work.min_prompt}..{work.max_prompt} "
        f"tokens, {work.max_tokens} new tokens each, greedy, ignore_eos; dtype {dtype}, "
        f"quantization {config.quantization}, KV cache {config.kv_cache_dtype}; "
        f"{args.rounds} interleaved rounds per mode"
    )
    results: dict[str, Any] = {}
    simulated = config.resolved_device() == "sim"
    if simulated:  # no weights run: the roofline is the cost model's device-bound ideal
        results["sim"] = compare_modes(options, prompts, work.max_tokens, args.rounds)
    else:
        from async_engine.bench.matmul import matmul_only_ms
        from async_engine.bench.structured import run_structured

        cores = os.cpu_count() or 1
        thread_counts = [config.resolved_device_threads()]
        if args.device_threads is None and cores not in thread_counts:
            thread_counts.append(cores)  # also show the device with every core
        for threads in thread_counts:
            runs = {**options, "device_threads": threads}
            r = compare_modes(runs, prompts, work.max_tokens, args.rounds)
            r["matmul_only_ms"] = matmul_only_ms(
                str(folder),
                dtype,
                r["full_decode_batch"],
                threads,
                device=config.resolved_device(),
                load_format=config.load_format,
                quantization=config.quantization,
            )
            if args.structured:
                r["structured_tokens_per_s"] = run_structured(runs, prompts, work.max_tokens)
            results[f"device_threads={threads}"] = r
    hf = None
    if not (args.skip_hf or simulated):
        hf = run_hf(str(folder), dtype, prompts, work.max_tokens)
    peers = run_peers(args, str(folder), dtype, prompts, work.max_tokens)
    roofline = "device-bound ideal" if simulated else "roofline"
    print_table(results, hf, roofline=roofline, peers=peers, cpu=describe(cpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": results, "hf": hf, "peers": peers, "cpu": cpu}, f, indent=2)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=20)
    p.add_argument("--max-prompt", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--rounds", type=int, default=2, help="interleaved runs per mode")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--structured",
        action="store_true",
        help="also run every request under a JSON schema (its cost)",
    )
    p.add_argument("--llama-server", default=None, help="llama-server binary: run it as a peer")
    p.add_argument(
        "--gguf",
        action="append",
        default=None,
        help="GGUF of the same model for --llama-server (any quantization; repeat for more)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vLLM's CPU build: run vLLM's LLM as a peer",
    )
    p.add_argument(
        "--vllm-bind",
        default="auto,all",
        help="comma-separated VLLM_CPU_OMP_THREADS_BIND values to run vLLM at "
        "('all' = every core; the best is its figure)",
    )
    p.add_argument("--json", default=None, help="write the figures to this file")
