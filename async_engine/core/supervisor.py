"""Device supervision: a lost device replaced now, later, or never, and its requests.

``Supervisor`` is asked before each restart attempt. Attempts (successful or not) are
budgeted over a sliding window, so a device that keeps dying ends the engine instead of
looping: an orchestrator then replaces the whole replica. A failed attempt backs off
exponentially. ``Recovery`` runs the engine's loop and, when the device is lost, settles
its requests: those whose reader has seen no output start over on the new device, the
others end with DEVICE_LOST; past the restart budget every request fails and the engine
refuses new ones.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from async_engine.core.device_host import DeviceHost
from async_engine.core.emitter import Emitter
from async_engine.core.loop import StepLoop
from async_engine.core.request import FinishReason
from async_engine.core.scheduler import Scheduler
from streams.device import DeviceError

log = structlog.get_logger("async_engine")


class DeviceState(enum.Enum):
    SERVING = "serving"
    RESTARTING = "restarting"  # the device was lost; a new one is starting
    FAILED = "failed"  # restarts kept failing: the engine refuses work for good


@dataclass(slots=True)
class RestartPolicy:
    max_restarts: int = 5  # attempts allowed within window_s
    window_s: float = 600.0
    backoff_s: float = 1.0  # wait after the first failed attempt; doubles after each
    max_backoff_s: float = 30.0


class Supervisor:
    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.state = DeviceState.SERVING
        self.restarts = 0  # devices replaced successfully, lifetime
        self.last_error: str | None = None
        self._attempts: deque[float] = deque()
        self._failed_in_a_row = 0
        # Called with each new state, on the engine's loop (a server's health follows it).
        self.listeners: list[Callable[[DeviceState], None]] = []

    def _enter(self, state: DeviceState) -> None:
        self.state = state
        for listener in self.listeners:
            listener(state)

    def next_attempt_delay(self, now: float | None = None) -> float | None:
        """Seconds to wait before the next attempt, or None: the budget is spent."""
        now = time.monotonic() if now is None else now
        policy = self.policy
        while self._attempts and self._attempts[0] < now - policy.window_s:
            self._attempts.popleft()
        if len(self._attempts) >= policy.max_restarts:
            return None
        delay = 0.0
        if self._failed_in_a_row:
            delay = min(policy.max_backoff_s, policy.backoff_s * 2 ** (self._failed_in_a_row - 1))
        self._attempts.append(now + delay)
        return delay

    def lost(self, error: str) -> None:
        self.last_error = error
        self._enter(DeviceState.RESTARTING)

    def attempt_failed(self) -> None:
        self._failed_in_a_row += 1

    def restarted(self) -> None:
        self.restarts += 1
        self._failed_in_a_row = 0
        self._enter(DeviceState.SERVING)

    def gave_up(self) -> None:
        self._enter(DeviceState.FAILED)


class Recovery:
    def __init__(
        self,
        supervisor: Supervisor,
        host: DeviceHost,
        scheduler: Scheduler,
        emitter: Emitter,
        loop: StepLoop,
    ) -> None:
        self.supervisor = supervisor
        self.host = host
        self.scheduler = scheduler
        self.emitter = emitter
        self.loop = loop  # it ends requests
        self.timeline = loop.timeline
        self.fatal_error: BaseException | None = None
        self.stopped = asyncio.Event()  # set when the engine stops for good

    async def run(self, loop_fn: Callable[[], Awaitable[None]]) -> None:
        """Run the engine's loop; after a lost device, replace it and go on."""
        while True:
            try:
                await loop_fn()
            except asyncio.CancelledError:
                raise
            except DeviceError as exc:
                if await self.recover(exc):
                    continue
                self.stop_for_good(exc, FinishReason.DEVICE_LOST)
                raise
            except BaseException as exc:  # a bug of the control plane's: nothing to retry
                self.stop_for_good(exc, FinishReason.ERROR)
                raise

    async def recover(self, exc: DeviceError) -> bool:
        """Replace a lost device; True once a new one serves, False if the budget is spent.

        Requests whose reader has taken no output yet start over (at most once: a request
        that was on two lost devices may be what kills them); the rest end with DEVICE_LOST.
        Submissions keep queueing meanwhile; health reports the restart.
        """
        loop = asyncio.get_running_loop()
        lost_at = time.monotonic()
        supervisor, host = self.supervisor, self.host
        supervisor.lost(str(exc))
        log.error(
            "device.lost",
            error=str(exc),
            restarts=supervisor.restarts,
            running=self.scheduler.num_running,
        )
        host.link.detach()
        # Decided before the first await: a reader that takes output meanwhile must not
        # find it dropped under it.
        ended, again = self.scheduler.device_lost(self.emitter.can_start_over)
        for req in ended:
            self.emitter.emit(req)
        for req in again:  # can_start_over saw a processor for each
            self.emitter.start_over(req)
        self.timeline.forget_inflight()
        await loop.run_in_executor(None, host.device.kill)
        while (delay := supervisor.next_attempt_delay()) is not None:
            await asyncio.sleep(delay)
            try:
                device = await loop.run_in_executor(None, host.start_device)
            except Exception as err:  # noqa: BLE001 - any failure to start is retried
                supervisor.attempt_failed()
                log.error("device.restart_failed", error=str(err))
                continue
            host.use(device, loop)
            supervisor.restarted()
            log.info(
                "device.restarted",
                restarts=supervisor.restarts,
                seconds=round(time.monotonic() - lost_at, 2),
                requeued=self.scheduler.num_waiting,
            )
            return True
        log.error("device.restart_budget_spent", limit=supervisor.policy.max_restarts)
        return False

    def stop_for_good(self, exc: BaseException, reason: FinishReason) -> None:
        """Fail every request and refuse new ones; their blocks return at once (no step of
        the lost device will ever complete)."""
        self.fatal_error = exc
        self.supervisor.gave_up()
        self.host.link.detach()
        ended, _ = self.scheduler.device_lost(lambda req: False, reason)
        for req in ended:
            self.emitter.emit(req)
        for req in list(self.scheduler.requests.values()):
            if not req.finished:
                self.loop.end(req, reason)
        self.stopped.set()
