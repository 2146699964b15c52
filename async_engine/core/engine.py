"""AsyncEngine: the control plane. One ``overlap_loop`` and its synchronous twin ``normal_loop``.

overlap_loop, per iteration:
    plan[N+1] = schedule()            # CPU work while step N runs on the device
    launch(plan[N+1])                 # enqueue; returns at once
    await out[N]                      # the device's completion fd wakes the event loop
    apply(plan[N], out[N])            # stops, frees, stream deltas out

A device that dies, hangs or overruns a step is replaced (``_recover``): requests whose
reader has seen no output start over on the new device, the others end with DEVICE_LOST,
and the engine serves again; past the restart budget it stops for good.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import gc
import os
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from async_engine.core.config import EngineConfig
from async_engine.core.handoff import DeviceLink
from async_engine.core.inputs import (
    DuplicateRequestError,
    InputBuilder,
    InputLimits,
    QueueFullError,
)
from async_engine.core.observer import StepObserver
from async_engine.core.output import (
    OutputProcessor,
    RequestDelta,
    UnreadBudget,
    request_timings,
)
from async_engine.core.pacing import StreamPacer
from async_engine.core.queues import make_queue
from async_engine.core.request import FinishReason, Request
from async_engine.core.scheduler import Scheduler, SchedulerConfig
from async_engine.core.stats import DeviceTimeline, EngineStats, PhaseClock
from async_engine.core.step_times import StepTimes
from async_engine.core.supervisor import DeviceState, RestartPolicy, Supervisor
from async_engine.core.tokenizer import Tokenizer
from async_engine.model import build_model, load_model_config, resolve_model
from blockalloc import BlockPool
from sampler.params import SamplingParams
from streams.device import Device, DeviceError, DeviceSpec
from streams.factory import create_device, model_spec, sim_spec
from streams.plan import StepPlan, StepResult
from streams.sim import cost_model

log = structlog.get_logger("async_engine")


class EngineClosedError(RuntimeError):
    pass


def _lower_thread_priority() -> None:
    """Nice the calling thread (Linux schedules threads alone); elsewhere, nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class AsyncEngine:
    SPIN_BELOW_S = 5e-3  # device steps shorter than this are awaited by polling
    # Plan the next step only after the one in flight where the control plane's work per
    # step is under this share of a step (a CPU's): the device waits that long, and a
    # request arriving meanwhile rides the next step.
    PLAN_AFTER_STEP_BELOW = 0.02
    OFF_LOOP_CHARS = 16_384  # text prompts at least this long are tokenized off the loop

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        device_wrapper: Callable[[Device], Device] | None = None,
        **overrides: Any,
    ) -> None:
        self.config = config = config or EngineConfig(**overrides)
        self.model_path = folder = resolve_model(config.model)
        self.model_config = mc = load_model_config(folder)
        has_tokenizer = any((folder / n).exists() for n in ("tokenizer.json", "tokenizer.model"))
        self.tokenizer = Tokenizer(folder) if has_tokenizer else None
        self.dtype = config.resolved_dtype()
        self.device_kind = config.resolved_device()
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)  # fmt: skip
        self._device_wrapper = device_wrapper  # tests inject faults here; the engine never does
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        # A GPU sizes its own pool from free memory (gpu_memory_utilization): start it first.
        self.device = self._start_device(num_blocks or None)
        num_blocks = num_blocks or getattr(self.device, "info", {})["num_blocks"]
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_cache)
        queue = make_queue(config.scheduling_policy, config.resolved_tenant_weights(),
                           config.default_tenant_weight)  # fmt: skip
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            self.max_model_len, config.block_size,
                            compute_bound=self.device_kind == "cpu"),
            self.pool,
            queue,
        )  # fmt: skip
        eos = tuple(mc.eos_token_ids)
        self.inputs = InputBuilder(
            InputLimits(mc.vocab_size, self.max_model_len, num_blocks, config.block_size, eos),
            self.tokenizer,
        )
        self.timeline = DeviceTimeline()
        self.phase_clock = PhaseClock()
        self._outputs: dict[str, OutputProcessor] = {}  # per request, until released
        self._num_streaming = 0  # readers that want output before the end
        self.link = self._new_link()
        self.supervisor = Supervisor(RestartPolicy(config.device_restart_limit))
        self.stopped = asyncio.Event()  # set when the engine stops for good (see fatal_error)
        self._timed: list[Request] = []  # requests with a queue or time limit
        self.observer: StepObserver | None = None  # a profiler's hooks, injected
        self.pacer = StreamPacer()
        self.unread = UnreadBudget(config.max_unread_bytes_per_stream, config.max_unread_bytes)
        self._step_s = 0.0  # moving average of the device's step time
        self.step_times = StepTimes()  # by step size: when to plan, when a step is hung
        self._step_started_at = 0.0  # when the step in flight began (about; control clock)
        # How step N+1 is planned: "overlap" (while step N runs), "after-step" (once N ended,
        # or at 1.25x its expected time: the control plane is a sliver of a step, as on a
        # CPU) or "sync" (overlap off). Chosen per step from measurements; see stats().
        self.planning_mode = "overlap" if config.overlap else "sync"
        # Control-plane work of recent steps; its median ignores a one-off slow step (the
        # first detokenization, a garbage collection).
        self._control_times: collections.deque[float] = collections.deque(maxlen=16)
        self._control_acc = 0.0  # this step's so far
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self.fatal_error: BaseException | None = None
        self._grammars: Any = None  # streams.grammar.Grammars, on the first structured request
        # One thread for tokenizing and grammar compiles, at a lower CPU priority: a flood
        # of heavy submissions queues behind itself and yields the cores to the event loop
        # and the device instead of taking them.
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="prepare",
                                                initializer=_lower_thread_priority)  # fmt: skip

    def _start_device(self, num_blocks: int | None = None) -> Device:
        """A new device process (blocks until it is ready: seconds, a model load). A restart
        keeps the pool's size."""
        if num_blocks is None and hasattr(self, "pool"):
            num_blocks = self.pool.num_blocks
        device = create_device(self._device_spec(num_blocks))
        return device if self._device_wrapper is None else self._device_wrapper(device)

    def _new_link(self) -> DeviceLink:
        return DeviceLink(self.device, self._on_step_done, self.config.device_heartbeat_timeout_s)

    def _device_spec(self, num_blocks: int | None) -> DeviceSpec:
        config, bs = self.config, self.config.block_size
        max_blocks_per_row = -(-self.max_model_len // bs)
        if self.device_kind == "sim":
            cost = cost_model(config.sim_preset, config.sim_step_ms, config.sim_token_us,
                              config.sim_seq_us, config.sim_ctx_ns)  # fmt: skip
            mc = self.model_config
            return sim_spec(cost, mc.vocab_size, tuple(mc.eos_token_ids), bs, max_blocks_per_row)
        model = functools.partial(build_model, str(self.model_path), self.dtype, self.device_kind,
                                  load_format=config.load_format, seed=config.seed)  # fmt: skip
        tokenizer = str(self.model_path) if self.tokenizer is not None else None
        # The fair scheduler admits up to a quarter over max_num_seqs: graphs cover that too.
        graph_max_batch = -(-config.max_num_seqs * 5 // 4)
        return model_spec(self.device_kind, model, num_blocks, bs, max_blocks_per_row,
                          config.resolved_device_threads(), tokenizer,
                          config.resolved_device_runner() == "pipelined", config.cuda_graphs,
                          graph_max_batch, config.gpu_memory_utilization,
                          config.max_num_batched_tokens)  # fmt: skip

    def _default_num_blocks(self) -> int:
        """0 where the pipelined GPU runner measures free memory itself."""
        if self.device_kind == "cuda" and self.config.resolved_device_runner() == "pipelined":
            return 0
        mc, bs = self.model_config, self.config.block_size
        itemsize = 4 if self.dtype == "float32" else 2
        block_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * bs * itemsize
        # A simulated device holds no KV cache: size its pool like a GPU's.
        budget = (1 << 30) if self.device_kind == "cpu" else (16 << 30)
        wanted = self.config.max_num_seqs * -(-self.max_model_len // bs)
        return max(16, min(wanted, budget // block_bytes))

    # ------------------------------------------------------------ public API
    async def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        **options: Any,
    ) -> AsyncIterator[RequestDelta]:
        """Stream a request's output. Leaving the loop early (or being cancelled) aborts it."""
        req = self.add_request(prompt, params, request_id, **options)
        try:
            async for delta in self.stream(req):
                yield delta
        finally:
            self.release(req)

    async def stream(self, req: Request) -> AsyncIterator[RequestDelta]:
        """Deltas of a queued request, until its final one; pair with ``release``."""
        stream = self._outputs[req.request_id].stream
        while True:
            delta = await stream.get()
            yield delta
            if delta.finished:
                return

    def release(self, req: Request) -> None:
        """The consumer is gone: abort the request if it still runs and drop its stream."""
        if not req.finished:
            self.finish(req.request_id)
        processor = self._outputs.pop(req.request_id, None)
        if processor is not None:
            processor.stream.discard()
            if not processor.quiet_until_finished:
                self._num_streaming -= 1

    def add_request(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        detokenize: bool = True,
        stream: bool = True,
        **options: Any,
    ) -> Request:
        """Validate and queue a request (call from the event loop's thread)."""
        self._ensure_started()
        if request_id and (request_id in self._outputs or request_id in self.scheduler.requests):
            # An ended request keeps its id until its last launched step has completed.
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        if params is not None and params.structured_output is not None:
            self.check_structured_output(params)
        req = self.inputs.build(prompt, params, request_id=request_id, **options)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        processor = OutputProcessor(req, self.tokenizer, detokenize, final_only=not stream,
                                    budget=self.unread)  # fmt: skip
        self._outputs[req.request_id] = processor
        if not processor.quiet_until_finished:
            self._num_streaming += 1
        self.scheduler.add_request(req)
        if req.queue_deadline is not None or req.time_deadline is not None:
            self._timed.append(req)
        assert self._wake is not None
        self._wake.set()
        return req

    async def prepare(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str | list[int] | None:
        """The slow parts of a submission, on a worker thread instead of the event loop every
        stream shares: templating and tokenizing a chat (``messages``, with ``tools``),
        tokenizing a long text prompt (the Rust tokenizer drops the GIL) and compiling a
        grammar (the first reads the tokenizer's vocabulary). Cheap refusals (text that
        cannot fit the context) come first, on the loop. Returns the prompt, as token ids
        where it was tokenized (a chat always is: pass those, not the messages, to
        ``add_request``), which then finds the grammar cached. Raises ValueError naming
        messages, prompt or structured_output."""
        loop = asyncio.get_running_loop()
        if messages is not None:
            if prompt is not None:
                raise ValueError("prompt: give either a prompt or messages, not both")
            self.inputs.check_chat_fits(messages)
        if params is not None and params.structured_output is not None:
            await loop.run_in_executor(self._prepare_pool, self.check_structured_output, params)
        if messages is not None:
            return await loop.run_in_executor(self._prepare_pool, self.inputs.chat_ids,
                                              messages, tools)  # fmt: skip
        if not isinstance(prompt, str) or len(prompt) < self.OFF_LOOP_CHARS or not self.tokenizer:
            return prompt
        self.inputs.check_text_fits(prompt)
        return await loop.run_in_executor(self._prepare_pool, self.tokenizer.encode, prompt)

    def check_structured_output(self, params: SamplingParams) -> None:
        """Compile the request's grammar here first, so a bad one is a ValueError naming
        structured_output at submission, never a failed step on the device. The first call
        reads the tokenizer's vocabulary (under a second); compiled grammars are cached."""
        spec = params.structured_output
        if spec is None:
            return
        if self.device_kind == "sim":
            raise ValueError("structured_output: the simulated device does not constrain output")
        from streams.grammar import Grammars

        if self._grammars is None:
            folder = str(self.model_path) if self.tokenizer is not None else None
            self._grammars = Grammars(folder, self.model_config.vocab_size)
        self._grammars.compile(*spec)

    async def abort(self, request_id: str) -> bool:
        """Abort a request at the next step boundary; False if unknown or already finished."""
        return self.finish(request_id)

    def finish(self, request_id: str, reason: FinishReason = FinishReason.ABORTED) -> bool:
        """End a request now with ``reason`` (abort, error, time or queue limit).

        Its reader gets the final delta; its blocks return after its last launched step.
        False if the id is unknown or the request had already ended.
        """
        req = self.scheduler.requests.get(request_id)
        if req is None or req.finished:
            return False
        req.abort_time = time.monotonic()
        self.scheduler.finish(req, reason)
        self._emit(req)
        return True

    async def replay(self, plans: list[StepPlan]) -> float:
        """Run recorded plans back to back on the device (the roofline); seconds taken."""
        self._ensure_started()
        return await self.link.replay(plans)

    def stats(self) -> EngineStats:
        return EngineStats.collect(self)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._shutdown()

    def close(self) -> None:
        """Close from outside the event loop (or after it stopped)."""
        self._closed = True
        if self._task is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._shutdown()

    def _shutdown(self) -> None:
        self.link.detach()
        self.device.close()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------- the loops
    def _ensure_started(self) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        if self.fatal_error is not None:
            raise EngineClosedError(f"engine stopped: {self.fatal_error}")
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.link.attach(self._loop)
        loop_fn = self.overlap_loop if self.config.overlap else self.normal_loop
        if self.config.freeze_gc:
            # Everything alive now (torch, transformers, the tokenizer: ~300k objects) stays
            # alive; a full collection walks them all (~200 ms), and the hot loop's
            # allocations trigger one every few seconds. Frozen, they are never walked.
            gc.collect()
            gc.freeze()
        self._task = self._loop.create_task(self._run(loop_fn), name="async-engine-loop")

    async def _run(self, loop_fn: Any) -> None:
        while True:
            try:
                await loop_fn()
            except asyncio.CancelledError:
                raise
            except DeviceError as exc:
                if await self._recover(exc):
                    continue
                self._stop_for_good(exc, FinishReason.DEVICE_LOST)
                raise
            except BaseException as exc:  # a bug of the control plane's: nothing to retry
                self._stop_for_good(exc, FinishReason.ERROR)
                raise

    def _stop_for_good(self, exc: BaseException, reason: FinishReason) -> None:
        """Fail every request and refuse new ones; their blocks return at once (no step of
        the lost device will ever complete)."""
        self.fatal_error = exc
        self.supervisor.gave_up()
        self.link.detach()
        ended, _ = self.scheduler.device_lost(lambda req: False, reason)
        for req in ended:
            self._emit(req)
        for req in list(self.scheduler.requests.values()):
            self.finish(req.request_id, reason)
        self.stopped.set()

    async def _recover(self, exc: DeviceError) -> bool:
        """Replace a lost device; True once a new one serves, False if the budget is spent.

        Requests whose reader has taken no output yet start over (at most once: a request
        that was on two lost devices may be what kills them); the rest end with DEVICE_LOST.
        Submissions keep queueing meanwhile; health reports the restart.
        """
        loop = asyncio.get_running_loop()
        lost_at = time.monotonic()
        self.supervisor.lost(str(exc))
        log.error("device.lost", error=str(exc), restarts=self.supervisor.restarts,
                  running=self.scheduler.num_running)  # fmt: skip
        self.link.detach()
        # Decided before the first await: a reader that takes output meanwhile must not
        # find it dropped under it.
        ended, again = self.scheduler.device_lost(self._can_start_over)
        for req in ended:
            self._emit(req)
        for req in again:  # _can_start_over saw a processor for each
            self._outputs[req.request_id].start_over()
        self.timeline.forget_inflight()
        await loop.run_in_executor(None, self.device.kill)
        while (delay := self.supervisor.next_attempt_delay()) is not None:
            await asyncio.sleep(delay)
            try:
                device = await loop.run_in_executor(None, self._start_device)
            except Exception as err:  # noqa: BLE001 - any failure to start is retried
                self.supervisor.attempt_failed()
                log.error("device.restart_failed", error=str(err))
                continue
            self.device = device
            self.link = self._new_link()
            self.link.attach(loop)
            self.supervisor.restarted()
            log.info("device.restarted", restarts=self.supervisor.restarts,
                     seconds=round(time.monotonic() - lost_at, 2),
                     requeued=self.scheduler.num_waiting)  # fmt: skip
            return True
        log.error("device.restart_budget_spent", limit=self.config.device_restart_limit)
        return False

    def _can_start_over(self, req: Request) -> bool:
        processor = self._outputs.get(req.request_id)
        return (
            processor is not None
            and processor.stream.delivered_tokens == 0
            and req.num_device_losses == 0
        )

    @property
    def num_streams(self) -> int:
        """Output streams held for readers (each until its reader releases it)."""
        return len(self._outputs)

    @property
    def device_state(self) -> DeviceState:
        return self.supervisor.state

    async def overlap_loop(self) -> None:
        inflight: tuple[StepPlan, asyncio.Future] | None = None
        while True:
            if inflight is not None and await self._ended_before_planning(*inflight):
                self._apply(inflight[0], await self._wait(*inflight))
                inflight = None
            plan = self._schedule()
            launched = self._launch(plan) if plan is not None else None
            if inflight is not None:
                self._apply(inflight[0], await self._wait(*inflight))
            inflight = launched
            if inflight is None:
                await self._wait_for_work()

    async def normal_loop(self) -> None:
        while True:
            plan = self._schedule()
            if plan is None:
                await self._wait_for_work()
                continue
            launched = self._launch(plan)
            self._apply(plan, await self._wait(*launched))

    async def _ended_before_planning(self, plan: StepPlan, future: asyncio.Future) -> bool:
        """Where the control plane's work is a sliver of a step (a CPU's ~1 ms beside tens
        of ms), plan the next step once the one in flight has ended, or a quarter past its
        expected end if it runs over: a request arriving meanwhile rides the next step,
        not the one after, a whole step sooner, for at most 2 % more device idle. True if
        the step ended first. Sets ``planning_mode`` to the mode it chose."""
        expected = self.step_times.predict(len(plan.input_ids))
        if expected is None or not self._control_times:
            self.planning_mode = "overlap"
            return False
        if statistics.median(self._control_times) > self.PLAN_AFTER_STEP_BELOW * expected:
            # GPU-speed steps: plan at once, the queue ahead is what keeps it busy.
            self.planning_mode = "overlap"
            return False
        self.planning_mode = "after-step"
        delay = self._step_started_at + 1.25 * expected - time.monotonic()
        if delay <= 0:
            return False
        done, _ = await asyncio.wait((future,), timeout=delay)
        return bool(done)

    def _schedule(self) -> StepPlan | None:
        start = time.monotonic()
        if self._timed:
            self._expire(start)
        plan = self.scheduler.schedule()
        if plan is not None:
            self._phase("schedule", plan.step_id, start, time.monotonic())
        return plan

    def _expire(self, now: float) -> None:
        """End requests past their limits; runs at step boundaries, like aborts."""
        keep = []
        for req in self._timed:
            if req.finished:
                continue
            if req.queue_deadline is not None and req.scheduled_time is None:
                if now >= req.queue_deadline:
                    self.finish(req.request_id, FinishReason.QUEUE_TIMEOUT)
                    continue
            if req.time_deadline is not None and now >= req.time_deadline:
                self.finish(req.request_id, FinishReason.TIME_LIMIT)
                continue
            keep.append(req)
        self._timed = keep

    async def _wait(self, plan: StepPlan, future: asyncio.Future) -> StepResult:
        start = time.monotonic()
        result = await self.link.result(future, self._spin_budget(), self._step_timeout(plan))
        resumed = time.monotonic()
        step = result.device_end - result.device_start
        self._step_s += 0.1 * (step - self._step_s)
        self.step_times.observe(len(plan.input_ids), step)
        self._control_times.append(self._control_acc)
        self._control_acc = 0.0
        self._step_started_at = resumed  # the next step, queued behind this one, starts now
        self._phase("wait", plan.step_id, start, resumed)
        # From when the engine could go on (waiting, result in) to when the loop let it.
        # Only GPU-speed steps are paced: beside a CPU step of 10 ms and more, the delay
        # is mostly the OS scheduling the loop's thread among busy device threads, and
        # coalescing tokens would only lengthen inter-token latency.
        held_up = resumed - max(start, result.device_end)
        self.pacer.observe(held_up if step < self.SPIN_BELOW_S else 0.0, step, self._num_streaming)
        return result

    def _step_timeout(self, plan: StepPlan) -> float:
        """Past this a step is hung: the configured floor, or 20x what steps of its size
        took lately (a long prefill chunk may run far longer than a decode)."""
        expected = self.step_times.predict(len(plan.input_ids)) or 0.0
        return max(self.config.device_step_timeout_s, 20.0 * expected)

    def _spin_budget(self) -> float:
        """Poll for results only where steps are short: a CPU step of 50 ms is waited for
        asleep, a GPU-speed one awake (see DeviceLink.result)."""
        if self._step_s > self.SPIN_BELOW_S:
            return 0.0
        return 2.0 * self._step_s + 1e-3

    async def _wait_for_work(self) -> None:
        assert self._wake is not None
        if self.scheduler.has_work() or self._timed:
            await asyncio.sleep(0.001)  # e.g. blocks of an ended request arrive next step
            return
        self._wake.clear()
        while True:  # idle: still notice a device that dies or hangs before the next request
            try:
                await asyncio.wait_for(self._wake.wait(), self.link.WATCHDOG_S)
                break
            except TimeoutError:
                self.link.check()
        self.timeline.mark_idle_engine()

    def _launch(self, plan: StepPlan) -> tuple[StepPlan, asyncio.Future]:
        start = time.monotonic()
        if not self.link.has_inflight():
            self._step_started_at = start  # an idle device starts it at once
        self.timeline.on_launch(plan.step_id, start)
        future = self.link.launch(plan)
        self._phase("launch", plan.step_id, start, time.monotonic())
        return plan, future

    def _on_step_done(self, plan: StepPlan, result: StepResult) -> None:
        self.timeline.on_result(result)
        if self.observer is not None:
            self.observer.on_device(plan, result)

    def _apply(self, plan: StepPlan, result: StepResult) -> None:
        start = time.monotonic()
        if result.error is not None:
            log.warning("step_failed", step=plan.step_id, error=result.error,
                        requests=plan.batch_size)  # fmt: skip
            touched = self.scheduler.fail_step(plan)
        else:
            touched = self.scheduler.update_from_output(
                plan, result.tokens, result.logprobs, result.top_logprobs
            )
        applied = time.monotonic()
        if not self._num_streaming:  # only whole results are wanted: emit just the ended
            touched = [req for req in touched if req.finished]
        outputs, pacer = self._outputs, self.pacer
        for req in touched:
            processor = outputs.get(req.request_id)
            if processor is None or not (req.finished or processor.wants_every_step):
                if processor is None or processor.quiet_until_finished:
                    continue
                if not pacer.due(processor.last_emit, applied):
                    continue  # its tokens wait for the next wake-up, merged into one chunk
            processor.last_emit = applied
            self._emit(req)
        self._phase("apply", plan.step_id, start, applied)
        self._phase("stream", plan.step_id, applied, time.monotonic())

    def _phase(self, name: str, step_id: int, start: float, end: float) -> None:
        self.phase_clock.add(name, end - start)
        if name != "wait":
            self._control_acc += end - start
        if self.observer is not None:
            self.observer.on_phase(name, step_id, start, end)

    def _emit(self, req: Request) -> None:
        processor = self._outputs.get(req.request_id)
        if processor is None or (processor.quiet_until_finished and not req.finished):
            return
        delta, matched = processor.process()
        if matched is not None and not req.finished:
            self.scheduler.finish(req, FinishReason.STOP, stop_reason=matched)
        if delta is None:
            return
        if req.finished:
            delta.finished = True
            delta.finish_reason = req.finish_reason
            delta.stop_reason = req.stop_reason
            delta.timings = request_timings(req)
        processor.stream.put(delta)
        if not req.finished and processor.stream.over_budget():
            # Its reader fell behind: end it rather than hold its output without bound.
            self.finish(req.request_id, FinishReason.UNREAD)
