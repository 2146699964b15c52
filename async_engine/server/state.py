"""What every front end of one server reads: the engine, the limits, who may call, the
metrics, the stream watchdog and whether the server is draining.

``GenerationServer`` builds it; the gRPC service and the OpenAI HTTP app each read it, so
neither depends on the other or on the server that runs them. Both submit through
``ServingState.submit``: the one place a request's metrics are wired, so each front end
counts the same and none counts twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from async_engine.core.engine import AsyncEngine
from async_engine.core.group import Prompt, RequestGroup, RequestOptions, submit
from async_engine.server.auth import Principals
from async_engine.server.codec import Limits
from async_engine.server.metrics import ServerMetrics
from async_engine.server.stalls import StalledStreams
from sampler.params import SamplingParams


@dataclass(slots=True)
class ServingState:
    engine: AsyncEngine
    metrics: ServerMetrics
    stalls: StalledStreams
    limits: Limits
    principals: Principals | None = None  # None: no auth, request ids are global
    draining: bool = False  # set once: new requests are refused on every front end
    warming: bool = False  # the server's warm-up runs: not ready for traffic yet

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str,
        options: RequestOptions,
    ) -> RequestGroup:
        """Queue a submission (``core.group.submit``); when the front end releases the
        group, each child's tokens, latencies and finish reason go to the metrics."""
        return submit(self.engine, prompt, params, request_id, options, self.metrics.on_release)

    def load(self) -> int:
        """Requests running plus waiting: the figure routers poll (``GET /get_load``), from
        the same engine stats as gRPC ``GetLoad``'s ``running`` and ``waiting``."""
        stats = self.engine.stats()
        return stats.running + stats.waiting
