"""One replica's serving parts, without Ray: the engine, the state the OpenAI handlers read,
the background tasks a server runs (metrics, the stalled-stream watch), health and drain.

``replica.py`` wraps this in a Serve deployment; keeping Ray out of here lets the tests
check health and drain on a plain event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import structlog

from async_engine.core.engine import AsyncEngine
from async_engine.core.fanout import parent_id
from async_engine.core.supervisor import DeviceState
from async_engine.ray_serve.asgi import ReplicaAsgi
from async_engine.ray_serve.coalesce import DEFAULT_MESSAGES_PER_S, Pace, StreamCounts
from async_engine.server.codec import Limits
from async_engine.server.http.app import OpenAIApp
from async_engine.server.logs import ensure_logging
from async_engine.server.metrics import ServerMetrics
from async_engine.server.stalls import StalledStreams
from async_engine.server.state import ServingState
from sampler.params import SamplingParams

log = structlog.get_logger("async_engine.ray_serve")


@dataclass(slots=True)
class ReplicaOptions:
    """What a replica sets besides the engine: the HTTP server's limits and timeouts, and
    the pacing of streamed responses (``coalesce.Pace``)."""

    limits: Limits = field(default_factory=Limits)
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0
    stream_idle_timeout_s: float = 60.0
    messages_per_s: float | None = DEFAULT_MESSAGES_PER_S  # None: an event, a Ray message
    max_interval_s: float = 0.05
    metrics_interval_s: float = 0.25
    abort_grace_s: float = 0.5  # at shutdown, how long aborted streams get to end
    warmup: bool = True


class ReplicaServer:
    """Builds its engine at once (the device starts here, before any loop runs it); ``start``
    runs on the loop that will serve."""

    def __init__(self, engine_options: dict[str, Any], options: ReplicaOptions) -> None:
        ensure_logging()
        self.options = options
        self.engine = engine = AsyncEngine(**engine_options)
        metrics = ServerMetrics(
            str(engine.config.model), engine.config.block_size, engine.pool.num_blocks
        )
        stalls = StalledStreams(options.stream_idle_timeout_s)
        self.state = ServingState(engine, metrics, stalls, options.limits)
        self.counts = StreamCounts()
        self.abandoned = 0  # responses cancelled with their requests still running
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    async def start(self) -> ReplicaAsgi:
        """Warm up, start the background tasks, and return the app to serve."""
        opts = self.options
        if opts.warmup:
            await self._warm_up()
        self._tasks = [
            asyncio.create_task(self._refresh_metrics(), name="metrics-refresh"),
            asyncio.create_task(self.state.stalls.watch(), name="stalled-streams"),
        ]
        openai = OpenAIApp(self.state, opts.max_body_bytes, opts.body_timeout_s)
        pace = Pace(opts.messages_per_s, opts.max_interval_s)
        log.info("replica.ready", model=str(self.engine.config.model), pace=str(pace))
        return ReplicaAsgi(openai.app, pace, self.counts, self.shutdown, self.abandon)

    def health_error(self) -> str | None:
        """Why the replica should be replaced, or None. A device being replaced is not a
        reason: the engine restarts it itself, and replacing the replica would lose the
        requests the restart keeps. Nor is draining: Serve drains the replicas it stops."""
        engine = self.engine
        if engine.fatal_error is not None or engine.device_state is DeviceState.FAILED:
            return f"engine stopped: {engine.fatal_error}"
        return None

    async def shutdown(self) -> None:
        """Serve drained what it could (its graceful shutdown); refuse anything new, abort
        what still runs, close the engine."""
        if self._closed:
            return
        self._closed = True
        self.state.draining = True
        engine = self.engine
        running = [rid for rid, req in engine.scheduler.requests.items() if not req.finished]
        for request_id in running:
            engine.finish(request_id)
        log.info("replica.shutdown", aborted=len(running))
        deadline = asyncio.get_running_loop().time() + self.options.abort_grace_s
        while engine.num_streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)  # the aborted streams' last events go out
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await engine.aclose()

    def abandon(self, request_id: str) -> None:
        """End the engine requests of a response nobody reads any more (its samples too)."""
        engine = self.engine
        ended = [
            rid
            for rid in list(engine.scheduler.requests)
            if rid == request_id or parent_id(rid) == request_id
        ]
        for rid in ended:
            engine.finish(rid)
        if ended:
            self.abandoned += 1

    def stats(self) -> dict[str, Any]:
        """The engine's figures and the pacing counts, for callers outside HTTP."""
        stats = self.engine.stats()
        return {
            "pid": os.getpid(),  # tells the replicas apart: Serve picks one per call
            "running": stats.running,
            "waiting": stats.waiting,
            "kv_usage": stats.kv_usage,
            "stream_messages": self.counts.messages,
            "stream_events": self.counts.events,
            "active_streams": self.counts.active_streams,
            "abandoned": self.abandoned,
            "cut_short": self.counts.cut_short,
            "last_cut_short_at": self.counts.last_cut_short_at,
        }

    async def _warm_up(self) -> None:
        """One tiny request, so that the first client does not pay for lazy set-up."""
        token = min(100, self.engine.model_config.vocab_size - 1)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in self.engine.generate([token] * 4, params, detokenize=False):
            pass

    async def _refresh_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a metrics bug must not stop the replica
                self.state.metrics.refresh(self.engine)
            await asyncio.sleep(self.options.metrics_interval_s)
