"""The application builder for Serve's own CLI:

    serve run async_engine.ray_serve.builder:app device=sim replicas=2
    serve run async_engine.ray_serve.builder:app autoscale_min=1 autoscale_max=4 \\
        router=prefix-affinity model=/models/llama

Every argument is a string: the deployment's (below) or any ``EngineConfig`` field, by
its name (``max_num_seqs=128``; dashes work too).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from async_engine.core.config import EngineConfig
from async_engine.ray_serve.app import Autoscaling, build_app
from async_engine.ray_serve.serving import ReplicaOptions

DEPLOYMENT_ARGS = (
    "replicas",
    "autoscale_min",
    "autoscale_max",
    "target_ongoing_requests",
    "router",
    "messages_per_s",
    "max_ongoing_requests",
    "graceful_shutdown_timeout_s",
)


def app(args: dict[str, str]) -> Any:
    """Serve calls this with the ``key=value`` arguments of ``serve run``."""
    given = {key.replace("-", "_"): value for key, value in args.items()}
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(given) - engine_fields - set(DEPLOYMENT_ARGS))
    if unknown:
        raise ValueError(
            f"unknown arguments {', '.join(unknown)}: expected EngineConfig fields or "
            f"{', '.join(DEPLOYMENT_ARGS)}"
        )
    hints = typing.get_type_hints(EngineConfig)
    engine = {k: convert(hints[k], v) for k, v in given.items() if k in engine_fields}
    budget = given.get("messages_per_s")
    options = ReplicaOptions()
    if budget is not None:
        options.messages_per_s = float(budget) or None  # 0: no pacing
    return build_app(
        engine,
        replicas(given),
        given.get("router", "default"),
        options,
        max_ongoing_requests=int(given.get("max_ongoing_requests", 0)) or None,
        graceful_shutdown_timeout_s=float(given.get("graceful_shutdown_timeout_s", 30.0)),
    )


def replicas(given: dict[str, str]) -> int | Autoscaling:
    """A fixed count, or autoscaling when either bound is given."""
    if "autoscale_min" in given or "autoscale_max" in given:
        low = int(given.get("autoscale_min", 1))
        high = int(given.get("autoscale_max", max(low, 2)))
        target = given.get("target_ongoing_requests")
        return Autoscaling(low, high, float(target) if target else None)
    return int(given.get("replicas", 1))


def convert(hint: Any, text: str) -> Any:
    """A command-line string as the field's type (``none`` for an optional one's None)."""
    if isinstance(hint, types.UnionType):
        if text.lower() == "none":
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        if text.lower() in ("1", "true", "on", "yes"):
            return True
        if text.lower() in ("0", "false", "off", "no"):
            return False
        raise ValueError(f"expected on or off, got {text!r}")
    return hint(text)
