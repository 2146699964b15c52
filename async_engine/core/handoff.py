"""The event-based handoff between the control plane and a device.

``launch`` enqueues a plan and returns a future at once; the device's completion fd wakes
the event loop, which resolves futures in step order. The event loop never blocks on the
device. A watchdog notices a device that died, stopped answering (its heartbeat went
quiet: a stopped or wedged process), or ran a step past its deadline; the link is then
``lost`` for good and the engine replaces the device.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from streams.device import REPLAY_STEP, Device, DeviceError
from streams.plan import StepPlan, StepResult

StepFuture = asyncio.Future  # resolves to StepResult


class DeviceLink:
    WATCHDOG_S = 0.5  # how often a wait with no result checks that the device is well

    def __init__(
        self,
        device: Device,
        on_result: Callable[[StepPlan, StepResult], None],
        heartbeat_timeout_s: float = 3.0,
    ) -> None:
        self.device = device
        self._on_result = on_result
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._futures: dict[int, StepFuture] = {}
        self._plans: dict[int, StepPlan] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.lost: DeviceError | None = None  # why the device can no longer be used

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
        if self.lost is not None:
            raise self.lost
        future = self._future(plan.step_id)
        self._plans[plan.step_id] = plan
        try:
            self.device.launch(plan)
        except DeviceError as exc:
            self._lose(exc)
            raise
        return future

    def has_inflight(self) -> bool:
        """Whether a launched step has not reported back yet."""
        return bool(self._futures)

    def check(self) -> None:
        """Raise DeviceError if the device died or stopped answering (or did so before)."""
        if self.lost is None:
            if not self.device.alive():
                self._lose(DeviceError("the device process died"))
            elif (age := self.device.heartbeat_age()) > self.heartbeat_timeout_s:
                self._lose(
                    DeviceError(f"the device stopped responding (no heartbeat for {age:.1f} s)")
                )
        if self.lost is not None:
            raise self.lost

    async def result(
        self, future: StepFuture, spin_s: float = 0.0, timeout_s: float = float("inf")
    ) -> StepResult:
        """The step's result. For up to ``spin_s`` the pipe is polled between turns of the
        event loop instead of sleeping in it: waking a vCPU from idle took ~0.2-1 ms on the
        machines we measured, as long as a whole GPU-speed step. A step still running after
        ``timeout_s`` loses the device."""
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
        deadline = time.monotonic() + timeout_s
        while True:
            done, _ = await asyncio.wait((future,), timeout=self.WATCHDOG_S)
            if done:
                return future.result()
            # No word from the device for a while: did we miss a wake-up, is it well?
            self._poll()
            if future.done():
                return future.result()
            self.check()
            if time.monotonic() > deadline:
                self._lose(DeviceError(f"a step ran past its deadline of {timeout_s:.1f} s"))
                return future.result()  # raises the loss

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

    def _lose(self, exc: DeviceError) -> None:
        """The device is gone: every waiter learns it, and nothing is read from it again."""
        self.lost = exc
        for future in self._futures.values():
            if not future.done():
                future.set_exception(exc)
                # The step after the failing one may never be awaited: without this,
                # asyncio logs a bare "exception was never retrieved" traceback for it.
                future.exception()
        self._futures.clear()
        self._plans.clear()
        self.detach()

    def _poll(self) -> None:
        if self.lost is not None:
            return
        try:
            results = self.device.collect()
        except Exception as exc:
            err = exc if isinstance(exc, DeviceError) else DeviceError(f"device failed: {exc!r}")
            self._lose(err)
            return
        for result in results:
            plan = self._plans.pop(result.step_id, None)
            if plan is not None:
                self._on_result(plan, result)
            future = self._futures.pop(result.step_id, None)
            if future is not None and not future.done():
                future.set_result(result)
