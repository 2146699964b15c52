"""AsyncEngine: the façade over the control plane's parts, one job each.

- intake (``core/intake.py``): a submission checked, built and queued, or refused by name;
- the scheduler (``core/scheduler.py``): which requests each step runs;
- the loop (``core/loop.py``): ``overlap_loop`` plans step N+1 while step N runs;
- the step clock (``core/step_clock.py``): every timing question, from one set of figures;
- the emitter (``core/emitter.py``): each request's stream, and whom a step wakes;
- the device host (``core/device_host.py``): the device process and the link to it;
- recovery (``core/supervisor.py``): a lost device replaced, its requests settled.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from async_engine.core import group
from async_engine.core.config import EngineConfig
from async_engine.core.device_host import DeviceHost
from async_engine.core.emitter import Emitter
from async_engine.core.group import RequestGroup, RequestOptions
from async_engine.core.handoff import DeviceLink
from async_engine.core.intake import Intake
from async_engine.core.loop import StepLoop
from async_engine.core.observer import StepObserver
from async_engine.core.output import RequestDelta, UnreadBudget
from async_engine.core.request import FinishReason, Request
from async_engine.core.scheduler import Scheduler, SchedulerConfig
from async_engine.core.stats import EngineStats
from async_engine.core.step_clock import StepClock
from async_engine.core.supervisor import DeviceState, Recovery, RestartPolicy, Supervisor
from async_engine.core.timeline import DeviceTimeline, PhaseClock
from async_engine.core.tokenizer import Tokenizer
from async_engine.kv_events import attach_kv_events
from async_engine.model import load_model_config, resolve_model
from blockalloc import BlockPool
from sampler.params import SamplingParams
from streams.device import Device
from streams.grammar import new_text_file
from streams.plan import StepPlan, StepResult


class EngineClosedError(RuntimeError):
    pass


class AsyncEngine:
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
        self.dtype = config.resolved_dtype()
        self.device_kind = config.resolved_device()
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        # The tokenizer's text for llguidance, written on the first structured request: the
        # device process then reads it instead of loading transformers (streams.grammar).
        self.tokenizer_text = new_text_file()
        # The tokenizer loads (about a second) while the device process starts (seconds).
        with ThreadPoolExecutor(1, "tokenizer-load") as pool:
            loading = pool.submit(Tokenizer, folder) if has_tokenizer else None
            self.host = DeviceHost(
                config,
                folder,
                mc,
                self.max_model_len,
                self._on_step_done,
                device_wrapper,
                self.tokenizer_text,
            )
            try:
                self.tokenizer = loading.result() if loading is not None else None
            except BaseException:
                self.host.close()
                raise
        num_blocks = self.host.num_blocks
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_cache)
        self.kv_events = attach_kv_events(config, self.pool)  # a no-op unless configured
        self.clock = StepClock(config.overlap, config.planning, config.device_step_timeout_s)
        sched_config = SchedulerConfig(
            self.max_model_len, config.block_size, config.resolved_speculative()
        )
        self.scheduler = Scheduler(sched_config, self.pool, config.build_policy(), self.clock)
        self.intake = Intake(
            config,
            mc,
            self.tokenizer,
            self.tokenizer_text,
            self.scheduler,
            self.max_model_len,
            num_blocks,
        )
        self.inputs = self.intake.inputs
        self.unread = UnreadBudget(config.max_unread_bytes_per_stream, config.max_unread_bytes)
        self.emitter = Emitter(self.tokenizer, self.unread)
        self.loop = StepLoop(self.scheduler, self.host, self.intake, self.emitter, self.clock)
        self.supervisor = Supervisor(RestartPolicy(config.device_restart_limit))
        self.recovery = Recovery(
            self.supervisor, self.host, self.scheduler, self.emitter, self.loop
        )
        self._task: asyncio.Task | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ------------------------------------------------------------ requests
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
        """Validate and queue a request (call from the event loop's thread); pair with
        ``stream`` and ``release``. Raises ValueError (and its subclasses
        DuplicateRequestError, QueueFullError) naming what is wrong."""
        self._ensure_started()
        taken = bool(request_id) and (
            self.emitter.holds(request_id) or request_id in self.scheduler.requests
        )
        req = self.intake.build(prompt, params, request_id, taken, options)
        self.emitter.open(req, detokenize, stream)
        self.scheduler.add_request(req)
        self.intake.queued(req)
        self.loop.wake.set()
        return req

    def submit(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | None,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> RequestGroup:
        """Queue a submission's ``params.n`` samples, all or none (``core/group.py``): the
        one path of the front ends."""
        return group.submit(self, prompt, params, request_id, options)

    def stream(self, req: Request) -> AsyncIterator[RequestDelta]:
        """Deltas of a queued request, until its final one; pair with ``release``."""
        return self.emitter.stream(req)

    def release(self, req: Request) -> None:
        """The consumer is gone: abort the request if it still runs and drop its stream."""
        if not req.finished:
            self.loop.end(req, FinishReason.ABORTED)
        self.emitter.release(req)

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
        return await self.intake.prepare(prompt, params, messages, tools)

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
        self.loop.end(req, reason)
        return True

    async def replay(self, plans: list[StepPlan]) -> float:
        """Run recorded plans back to back on the device (the roofline); seconds taken."""
        self._ensure_started()
        return await self.host.link.replay(plans)

    # ------------------------------------------------------------- state
    def stats(self) -> EngineStats:
        return EngineStats.collect(
            self.pool,
            self.scheduler,
            self.timeline,
            self.phase_clock,
            self.supervisor,
            self.planning_mode,
        )

    def tenant_depths(self, limit: int = 64) -> list[tuple[str, int, int]]:
        """(tenant, waiting, running) of tenants with work, most waiting first."""
        return self.scheduler.policy.tenant_depths(self.scheduler.requests.values(), limit)

    @property
    def num_streams(self) -> int:
        """Output streams held for readers (each until its reader releases it)."""
        return len(self.emitter.processors)

    @property
    def device_state(self) -> DeviceState:
        return self.supervisor.state

    @property
    def planning_mode(self) -> str:
        """How the last step was planned: overlap, after-step or sync (see StepClock)."""
        return self.clock.mode

    @property
    def device(self) -> Device:
        return self.host.device

    @property
    def link(self) -> DeviceLink:
        return self.host.link

    @property
    def timeline(self) -> DeviceTimeline:
        return self.loop.timeline

    @property
    def phase_clock(self) -> PhaseClock:
        return self.loop.phase_clock

    @property
    def observer(self) -> StepObserver | None:
        return self.loop.observer

    @observer.setter
    def observer(self, observer: StepObserver | None) -> None:
        self.loop.observer = observer

    @property
    def stopped(self) -> asyncio.Event:
        """Set when the engine stops for good (see ``fatal_error``)."""
        return self.recovery.stopped

    @property
    def fatal_error(self) -> BaseException | None:
        return self.recovery.fatal_error

    # --------------------------------------------------------- lifecycle
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
        loop = self._event_loop
        if self._task is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._task.cancel)
        self._shutdown()

    def _shutdown(self) -> None:
        self.host.close()
        self.intake.close()
        self.kv_events.close()
        Path(self.tokenizer_text).unlink(missing_ok=True)

    def _ensure_started(self) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        if self.fatal_error is not None:
            raise EngineClosedError(f"engine stopped: {self.fatal_error}")
        if self._task is not None:
            return
        self._event_loop = loop = asyncio.get_running_loop()
        self.host.attach(loop)
        loop_fn = self.loop.overlap_loop if self.config.overlap else self.loop.normal_loop
        if self.config.freeze_gc:
            # Everything alive now (torch, transformers, the tokenizer: ~300k objects) stays
            # alive; a full collection walks them all (~200 ms), and the hot loop's
            # allocations trigger one every few seconds. Frozen, they are never walked.
            gc.collect()
            gc.freeze()
        self._task = loop.create_task(self.recovery.run(loop_fn), name="async-engine-loop")

    def _on_step_done(self, plan: StepPlan, result: StepResult) -> None:
        self.loop.on_step_done(plan, result)
