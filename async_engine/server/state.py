"""What every front end of one server reads: the engine, the limits, who may call, the
metrics, the stream watchdog and whether the server is draining.

``GenerationServer`` builds it; the gRPC service and the OpenAI HTTP app each read it, so
neither depends on the other or on the server that runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from async_engine.core.engine import AsyncEngine
from async_engine.server.auth import Principals
from async_engine.server.codec import Limits
from async_engine.server.metrics import ServerMetrics
from async_engine.server.stalls import StalledStreams


@dataclass(slots=True)
class ServingState:
    engine: AsyncEngine
    metrics: ServerMetrics
    stalls: StalledStreams
    limits: Limits
    principals: Principals | None = None  # None: no auth, request ids are global
    draining: bool = False  # set once: new requests are refused on every front end
