"""Device supervision: whether a lost device may be replaced now, later, or never.

The engine asks before each restart attempt. Attempts (successful or not) are budgeted
over a sliding window, so a device that keeps dying ends the engine instead of looping:
an orchestrator then replaces the whole replica. A failed attempt backs off exponentially.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


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
