"""The Serve deployment: one ``AsyncEngine`` per replica, answering with the project's own
OpenAI handlers.

Serve's proxy hands each HTTP request straight to a replica's ASGI app (the default
layout). With the prefix-affinity router an ingress deployment parses the request first
and calls ``forward`` on a replica through a handle, since that router reads the prompt
from the call's arguments (see ``ingress.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from async_engine.ray_serve.asgi import ReplicaAsgi
from async_engine.ray_serve.serving import ReplicaOptions, ReplicaServer
from async_engine.ray_serve.tunnel import Forwarded, tunnel


class EngineDeployment:
    """The replica as a handle target (the ingress layout's): ``forward`` and the rest."""

    async def __init__(self, engine_options: dict[str, Any], options: ReplicaOptions) -> None:
        if direct_ingress():
            # Clients reach this replica's own HTTP server: no Ray message per event, so
            # nothing to save by holding events back.
            options = dataclasses.replace(options, messages_per_s=None)
        # The device process starts here; the rest runs on the loop requests run on. Not
        # `self.app`: Serve's ingress wrapper owns that name.
        self.server = ReplicaServer(engine_options, options)
        self.asgi = await self.server.start()

    async def check_health(self) -> None:
        """Serve replaces a replica whose check raises: only an engine that stopped for good."""
        error = self.server.health_error()
        if error is not None:
            raise RuntimeError(error)

    async def stats(self) -> dict[str, Any]:
        return self.server.stats()

    async def forward(self, request: Forwarded) -> AsyncIterator[list[dict[str, Any]]]:
        """An HTTP request an ingress parsed, answered by the same app as a direct one; its
        ASGI messages come back in batches (one Ray message each)."""
        async for batch in tunnel(self.asgi, request):
            yield batch

    async def __del__(self) -> None:
        """Serve's last call to a replica it stops, once its graceful drain is over."""
        await self.server.shutdown()


@serve.ingress()
class EngineReplica(EngineDeployment):
    """The replica as the application's ingress (the default layout): Serve's proxy hands
    it each HTTP request. Serve allows one ingress per application, hence two classes."""

    def __serve_build_asgi_app__(self) -> ReplicaAsgi:
        return self.asgi


def direct_ingress() -> bool:
    """Whether this cluster runs Serve's direct ingress (replicas serve HTTP themselves,
    behind HAProxy): the flags Ray 2.60 reads at start, on every node."""
    optimized = os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0") == "1"
    flag = os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1" if optimized else "0")
    return flag == "1"
