"""The built-in decode-heavy workload behind `async-engine profile`, and the tracer's cost.

Decode-heavy on purpose: that is where the control plane's share of a step is largest and
where overlap matters most (short prompts, one prefill step, then ``max_tokens`` decode steps).
The workload itself is async_engine.core.workload's, with one prompt length (min == max).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from async_engine.core.workload import Workload
from profiling.nvtx import profiler_start, profiler_stop
from profiling.report import Report, analyze
from profiling.trace import Trace
from profiling.tracer import StepTracer
from sampler.params import SamplingParams


@dataclass(slots=True)
class ProfileRun:
    overlap: bool
    trace: Trace
    report: Report
    tokens: int
    seconds: float
    speculation: str | None = None  # what speculative decoding did, where it ran

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def _check_fits(llm: Any, workload: Workload) -> None:
    limit = llm.engine.max_model_len
    longest = workload.max_prompt + workload.max_tokens
    if longest > limit:
        raise ValueError(
            f"steps: prompt_len + steps = {longest} exceeds the model's context length {limit}"
        )


def _warm_up(llm: Any, prompts: list[list[int]]) -> None:
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))


def run_profile(
    options: dict[str, Any], workload: Workload, cuda_window: bool = False
) -> ProfileRun:
    """Run the workload once with a tracer attached; cuda_window brackets the traced part with
    cudaProfilerStart/Stop (for ``nsys --capture-range=cudaProfilerApi``)."""
    from async_engine.core.llm import LLM

    with LLM(**options) as llm:
        _check_fits(llm, workload)
        prompts = workload.prompts(llm.engine.model_config.vocab_size)
        _warm_up(llm, prompts)
        before = llm.stats().as_dict()
        tracer = StepTracer.attach(llm.engine)
        if cuda_window:
            profiler_start()
        try:
            start = time.perf_counter()
            outs = llm.generate(prompts, workload.params())
            seconds = time.perf_counter() - start
        finally:
            if cuda_window:
                profiler_stop()
            llm.engine.observer = None
            tracer.close()
        after = llm.stats().as_dict()
    trace = tracer.snapshot()
    tokens = sum(len(o.token_ids) for o in outs)
    overlap = options.get("overlap", True)
    run = ProfileRun(overlap, trace, analyze(trace), tokens, seconds)
    run.speculation = speculation_summary(before, after)
    return run


def speculation_summary(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """Acceptance, mean accepted length and the verify steps' extra device time between two
    ``stats()``; None where nothing was verified."""
    delta = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in (
            "spec_num_drafts",
            "spec_num_draft_tokens",
            "spec_num_accepted_tokens",
            "spec_verify_steps",
            "spec_verify_device_seconds",
            "spec_verify_extra_device_seconds",
        )
    }
    steps = delta["spec_verify_steps"]
    if not steps:
        return None
    drafted, kept = delta["spec_num_draft_tokens"], delta["spec_num_accepted_tokens"]
    length = 1 + kept / delta["spec_num_drafts"] if delta["spec_num_drafts"] else 1.0
    extra = delta["spec_verify_extra_device_seconds"]
    return (
        f"acceptance {kept / drafted if drafted else 0.0:.2f} ({kept} of {drafted} drafts), "
        f"mean accepted length {length:.2f}; {steps} verify steps, "
        f"{1e3 * delta['spec_verify_device_seconds'] / steps:.2f} ms each on the device, "
        f"{1e3 * extra / steps:+.2f} ms beyond the same steps without drafts"
    )


@dataclass(slots=True)
class Overhead:
    tokens_per_s_off: list[float]
    tokens_per_s_on: list[float]
    callback_us_per_step: float  # the tracer's own time per step (5 phases + 1 device span)
    mean_step_s: float

    @property
    def throughput_ratio(self) -> float:
        """Median over rounds of tokens/s with the tracer / without (1.0 = free). Each round
        runs both back to back, so slow drift on a shared machine cancels; bursts do not."""
        pairs = zip(self.tokens_per_s_on, self.tokens_per_s_off, strict=True)
        return statistics.median(on / off for on, off in pairs)

    @property
    def estimated_cost(self) -> float:
        """Callback time as a share of a step: the cost with the machine's noise taken out."""
        return self.callback_us_per_step * 1e-6 / self.mean_step_s if self.mean_step_s else 0.0


def measure_overhead(options: dict[str, Any], workload: Workload, rounds: int = 5) -> Overhead:
    """Tokens/s with the tracer off and on, interleaved in one engine so drift cancels."""
    if rounds < 1:
        raise ValueError(f"rounds must be positive, got {rounds}")
    from async_engine.core.llm import LLM

    off: list[float] = []
    on: list[float] = []
    steps: list[float] = []
    with LLM(**options) as llm:
        _check_fits(llm, workload)
        prompts = workload.prompts(llm.engine.model_config.vocab_size)
        _warm_up(llm, prompts)
        for round_ in range(rounds):
            # Alternate which mode goes first, so neither always gets the warmer machine.
            for traced in (False, True) if round_ % 2 == 0 else (True, False):
                tracer = StepTracer.attach(llm.engine) if traced else None
                start = time.perf_counter()
                outs = llm.generate(prompts, workload.params())
                seconds = time.perf_counter() - start
                llm.engine.observer = None
                tokens = sum(len(o.token_ids) for o in outs)
                (on if traced else off).append(tokens / seconds)
                if tracer is not None:
                    steps.append(seconds / max(1, len(tracer)))
    return Overhead(off, on, callback_cost_us(workload.num_requests), statistics.median(steps))


def callback_cost_us(batch: int, repeats: int = 20_000) -> float:
    """Microseconds the tracer spends per step, timed on a synthetic decode step."""
    from streams.plan import StepPlan, StepResult, int32s, int64s

    rows = list(range(batch))
    plan = StepPlan(
        0,
        int32s(rows),
        int32s([63] * batch),
        int32s([1] * batch),
        int32s([1] * batch),
        int64s([-1] * batch),
    )
    result = StepResult(0, [0] * batch, device_start=1.0, device_end=2.0)
    tracer = StepTracer(nvtx=False)
    start = time.perf_counter()
    for i in range(repeats):
        for name in ("schedule", "launch", "wait", "apply", "stream"):
            tracer.on_phase(name, i, 1.0, 2.0)
        tracer.on_device(plan, result)
    return (time.perf_counter() - start) / repeats * 1e6
