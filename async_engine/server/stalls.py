"""Streams whose client stopped reading: their writes stall, and they are cancelled.

A handler blocked writing to a client that never reads would hold its RPC (and whatever
output it still has) forever, and a drain would wait for it. Every streaming handler
marks its writes; a watchdog cancels the handler whose current write has made no
progress for ``timeout_s``. Cancelling runs the handler's cleanup, which aborts its
requests, so their KV blocks return.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import structlog

log = structlog.get_logger("async_engine.server.stalls")


class StalledStreams:
    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"stream idle timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.cancelled = 0  # streams cancelled for stalling, lifetime
        self._writing: dict[asyncio.Task, float] = {}  # handler -> when its write began

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """Around one write (a ``yield`` of a streaming handler)."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._writing[task] = time.monotonic()
        try:
            yield
        finally:
            self._writing.pop(task, None)

    def cancel_stalled(self, older_than_s: float) -> int:
        """Cancel every handler whose write has waited longer than ``older_than_s``."""
        now, count = time.monotonic(), 0
        for task, since in list(self._writing.items()):
            if now - since > older_than_s and not task.done():
                task.cancel()
                self._writing.pop(task, None)
                count += 1
        if count:
            self.cancelled += count
            log.warning("stream.stalled", cancelled=count, stalled_s=older_than_s)
        return count

    @property
    def num_writing(self) -> int:
        return len(self._writing)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            self.cancel_stalled(self.timeout_s)
