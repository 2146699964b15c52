"""The event-based handoff between the control plane and a device.

``launch`` enqueues a plan and returns a future at once; the device's completion fd wakes
the event loop, which resolves futures in step order. The event loop never blocks on the
device, and a watchdog notices a device that died mid-step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from streams.device import REPLAY_STEP, Device, DeviceError
from streams.plan import StepPlan, StepResult

StepFuture = asyncio.Future  # resolves to StepResult


class DeviceLink:
    WATCHDOG_S = 2.0  # how often a step that has not finished checks the device is alive

    def __init__(self, device: Device, on_result: Callable[[StepPlan, StepResult], None]) -> None:
        self.device = device
        self._on_result = on_result
        self._futures: dict[int, StepFuture] = {}
        self._plans: dict[int, StepPlan] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.device.completion_fd(), self._poll)

    def detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self.device.completion_fd())
            except (OSError, ValueError, RuntimeError):
                pass  # already closed

    def launch(self, plan: StepPlan) -> StepFuture:
        future = self._future(plan.step_id)
        self._plans[plan.step_id] = plan
        self.device.launch(plan)
        return future

    async def result(self, future: StepFuture, spin_s: float = 0.0) -> StepResult:
        """The step's result. For up to ``spin_s`` the pipe is polled between turns of the
        event loop instead of sleeping in it: waking a vCPU from idle took ~0.2-1 ms on the
        machines we measured, as long as a whole GPU-speed step."""
        if not future.done():
            self._poll()  # a result already in the pipe needs no trip through the event loop
        if future.done():
            await asyncio.sleep(0)  # still let readers run once per step
            return future.result()
        if spin_s > 0.0:
            give_up = time.monotonic() + spin_s
            while time.monotonic() < give_up:
                await asyncio.sleep(0)  # readers and sockets run here, between polls
                self._poll()
                if future.done():
                    return future.result()
        while True:
            done, _ = await asyncio.wait((future,), timeout=self.WATCHDOG_S)
            if done:
                return future.result()
            # No word from the device for a while: is it alive, and did we miss a wake-up?
            if not self.device.alive():
                raise DeviceError("the device stopped while running a step")
            self._poll()

    async def replay(self, plans: list[StepPlan]) -> float:
        """Run recorded plans back to back on the device (the roofline); seconds taken."""
        future = self._future(REPLAY_STEP)
        self.device.launch_replay(plans)
        result = await self.result(future)
        return result.device_end - result.device_start

    def _future(self, step_id: int) -> StepFuture:
        if self._loop is None:
            raise RuntimeError("DeviceLink is not attached to an event loop")
        future = self._loop.create_future()
        self._futures[step_id] = future
        return future

    def _poll(self) -> None:
        try:
            results = self.device.collect()
        except Exception as exc:  # the device is gone: every waiter learns it
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(exc)
                    # The step after the failing one may never be awaited: without this,
                    # asyncio logs a bare "exception was never retrieved" traceback for it.
                    future.exception()
            self._futures.clear()
            self.detach()
            return
        for result in results:
            plan = self._plans.pop(result.step_id, None)
            if plan is not None:
                self._on_result(plan, result)
            future = self._futures.pop(result.step_id, None)
            if future is not None and not future.done():
                future.set_result(result)
