"""The engine's loop: one ``overlap_loop`` and its synchronous twin ``normal_loop``.

overlap_loop, per iteration:
    plan[N+1] = schedule()            # CPU work while step N runs on the device
    launch(plan[N+1])                 # enqueue; returns at once
    await out[N]                      # the device's completion fd wakes the event loop
    apply(plan[N], out[N])            # stops, frees, stream deltas out

Where the step clock says the control plane is a sliver of a step, step N+1 is planned
only once step N has ended (``StepClock.planning_delay``): a request arriving meanwhile
rides step N+1.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from async_engine.core.device_host import DeviceHost
from async_engine.core.emitter import Emitter
from async_engine.core.intake import Intake
from async_engine.core.observer import StepObserver
from async_engine.core.request import FinishReason, Request
from async_engine.core.scheduler import Scheduler
from async_engine.core.step_clock import StepClock
from async_engine.core.timeline import DeviceTimeline, PhaseClock
from streams.plan import StepPlan, StepResult

log = structlog.get_logger("async_engine")

Inflight = tuple[StepPlan, asyncio.Future]


class StepLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        host: DeviceHost,
        intake: Intake,
        emitter: Emitter,
        clock: StepClock,
    ) -> None:
        self.scheduler = scheduler
        self.host = host
        self.intake = intake
        self.emitter = emitter
        self.clock = clock
        self.timeline = DeviceTimeline()
        self.phase_clock = PhaseClock()
        self.observer: StepObserver | None = None  # a profiler's hooks, injected
        self.wake = asyncio.Event()

    async def overlap_loop(self) -> None:
        inflight: Inflight | None = None
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
        """Wait, as the step clock says, for the step in flight before planning the next;
        True if it ended first."""
        delay = self.clock.planning_delay(len(plan.input_ids))
        if delay is None or delay <= 0:
            return False
        done, _ = await asyncio.wait((future,), timeout=delay)
        return bool(done)

    def _schedule(self) -> StepPlan | None:
        start = time.monotonic()
        if self.intake.timed:
            for req, reason in self.intake.expired(start):
                self.end(req, reason)
        self.scheduler.compute_bound = self.clock.compute_bound
        plan = self.scheduler.schedule()
        if plan is not None:
            self._phase("schedule", plan.step_id, start, time.monotonic())
        return plan

    def _launch(self, plan: StepPlan) -> Inflight:
        start = time.monotonic()
        link = self.host.link
        self.clock.launched(start, device_idle=not link.has_inflight())
        self.timeline.on_launch(plan.step_id, start)
        future = link.launch(plan)
        self._phase("launch", plan.step_id, start, time.monotonic())
        return plan, future

    async def _wait(self, plan: StepPlan, future: asyncio.Future) -> StepResult:
        start = time.monotonic()
        clock, tokens = self.clock, len(plan.input_ids)
        result = await self.host.link.result(
            future, clock.spin_budget(), clock.hang_timeout(tokens)
        )
        resumed = time.monotonic()
        step = result.device_end - result.device_start
        clock.step_done(tokens, step, resumed)
        self._phase("wait", plan.step_id, start, resumed)
        # From when the engine could go on (waiting, result in) to when the loop let it.
        # Only GPU-speed steps are paced: beside a CPU step of 10 ms and more, the delay
        # is mostly the OS scheduling the loop's thread among busy device threads, and
        # coalescing tokens would only lengthen inter-token latency.
        held_up = resumed - max(start, result.device_end)
        if not clock.is_short_step(step):
            held_up = 0.0
        self.emitter.pacer.observe(held_up, step, self.emitter.num_streaming)
        return result

    async def _wait_for_work(self) -> None:
        if self.scheduler.has_work() or self.intake.timed:
            await asyncio.sleep(0.001)  # e.g. blocks of an ended request arrive next step
            return
        self.wake.clear()
        while True:  # idle: still notice a device that dies or hangs before the next request
            try:
                await asyncio.wait_for(self.wake.wait(), self.host.link.WATCHDOG_S)
                break
            except TimeoutError:
                self.host.link.check()
        self.timeline.mark_idle_engine()

    def end(self, req: Request, reason: FinishReason) -> None:
        """End a running or waiting request now (abort, time or queue limit, a lost device);
        its reader gets the final delta, its blocks return after its last launched step."""
        req.abort_time = time.monotonic()
        self.scheduler.finish(req, reason)
        ending = self.emitter.emit(req)
        if ending is not None:  # cannot be: it has ended; kept for the type's sake
            self.emitter.finish_ending(ending)

    def on_step_done(self, plan: StepPlan, result: StepResult) -> None:
        """The device reported a step (called by the link, possibly before it is awaited)."""
        self.timeline.on_result(result)
        if self.observer is not None:
            self.observer.on_device(plan, result)

    def _apply(self, plan: StepPlan, result: StepResult) -> None:
        start = time.monotonic()
        if result.error is not None:
            log.warning(
                "step_failed", step=plan.step_id, error=result.error, requests=plan.batch_size
            )
            touched = self.scheduler.fail_step(plan)
        else:
            touched = self.scheduler.update_from_output(plan, result)
        applied = time.monotonic()
        endings = self.emitter.emit_step(touched, self.scheduler.take_ended(), applied)
        for ending in endings:  # the output said so: a stop string, a reader far behind
            if ending.reason is FinishReason.UNREAD:
                ending.req.abort_time = applied
            self.scheduler.finish(ending.req, ending.reason, ending.stop_reason)
            self.emitter.finish_ending(ending)
        self._phase("apply", plan.step_id, start, applied)
        self._phase("stream", plan.step_id, applied, time.monotonic())

    def _phase(self, name: str, step_id: int, start: float, end: float) -> None:
        self.phase_clock.add(name, end - start)
        if name != "wait":
            self.clock.control_work(end - start)
        if self.observer is not None:
            self.observer.on_phase(name, step_id, start, end)
