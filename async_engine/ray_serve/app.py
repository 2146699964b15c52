"""``build_app``: the Serve application of an engine config, in one of two layouts.

- ``router="default"``: the proxy hands each HTTP request straight to a replica (Serve's
  power-of-two-choices picks it by queue length): one Ray hop.
- ``router="prefix-affinity"``: an ingress deployment reads the request and forwards it to
  a replica chosen by Ray's ``PrefixCacheAffinityRouter`` (prompts sharing a prefix meet on
  one replica, where the prefix cache holds their blocks): two hops.

Replicas are a fixed count or autoscaled on ongoing requests per replica.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from async_engine.core.config import EngineConfig
from async_engine.ray_serve.ingress import EngineIngress
from async_engine.ray_serve.replica import EngineDeployment, EngineReplica
from async_engine.ray_serve.serving import ReplicaOptions

ROUTERS = ("default", "prefix-affinity")
# The public path imports all of ray.serve.llm, which needs the ray[llm] extra (pyarrow
# and more); the router's own module needs only ray[serve].
PREFIX_ROUTERS = (
    "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
    ".PrefixCacheAffinityRouter",
)
# Serve runs a replica's code on a second event loop thread by default; every streamed
# message then crosses threads (and the GIL) twice. On the replica's own loop, 2 sim
# replicas streamed 8.6k tokens/s instead of 5.6k.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


@dataclass(slots=True, frozen=True)
class Autoscaling:
    """Replicas between ``min_replicas`` and ``max_replicas``, aiming at
    ``target_ongoing_requests`` each (running and queued in the replica; default the
    engine's ``max_num_seqs``: a replica scales out once its batch is full)."""

    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float | None = None

    def config(self, max_num_seqs: int) -> dict[str, Any]:
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests or float(max_num_seqs),
        }


def build_app(
    engine: EngineConfig | dict[str, Any] | None = None,
    num_replicas: int | Autoscaling | None = None,
    router: str = "default",
    options: ReplicaOptions | None = None,
    max_ongoing_requests: int | None = None,
    graceful_shutdown_timeout_s: float = 30.0,
    ray_actor_options: dict[str, Any] | None = None,
) -> Any:
    """The Serve application (pass it to ``serve.run``). ``num_replicas``: a count, an
    ``Autoscaling``, or None for one replica. ``max_ongoing_requests`` defaults to four
    times the engine's ``max_num_seqs``: past it Serve holds requests in its proxy, which
    probes the replicas again and again (each refusal a Ray call and a log line), while a
    request in the engine's queue costs nothing and is admitted fairly among tenants.
    ``ray_actor_options`` are merged over the defaults (a GPU per replica on CUDA)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    engine_options = _engine_options(engine)
    config = EngineConfig(**engine_options)  # a bad value fails here, not on every replica
    options = options or ReplicaOptions()
    settings: dict[str, Any] = {
        "max_ongoing_requests": max_ongoing_requests or 4 * config.max_num_seqs,
        "graceful_shutdown_timeout_s": graceful_shutdown_timeout_s,
        # The first replicas load the model and start a device: give them time.
        "health_check_timeout_s": 60.0,
        # An access-log line per request is a file write on the replica's loop.
        "logging_config": {"enable_access_log": False},
        "ray_actor_options": {**_actor_options(config), **(ray_actor_options or {})},
    }
    if isinstance(num_replicas, Autoscaling):
        settings["autoscaling_config"] = num_replicas.config(config.max_num_seqs)
    else:
        settings["num_replicas"] = num_replicas or 1
    if router == "prefix-affinity":
        settings["request_router_config"] = RequestRouterConfig(
            request_router_class=prefix_router()
        )
    if router == "default":
        return serve.deployment(EngineReplica).options(**settings).bind(engine_options, options)
    replica = serve.deployment(EngineDeployment).options(**settings).bind(engine_options, options)
    ingress = serve.deployment(EngineIngress).options(
        max_ongoing_requests=10_000,
        logging_config={"enable_access_log": False},
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV}},
    )
    return ingress.bind(replica, options.max_body_bytes)


def prefix_router() -> str:
    """The import path of Ray's PrefixCacheAffinityRouter that imports here."""
    for path in PREFIX_ROUTERS:
        module, _, name = path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        return path
    raise RuntimeError("Ray's PrefixCacheAffinityRouter does not import: pip install 'ray[llm]'")


def _actor_options(config: EngineConfig) -> dict[str, Any]:
    """A GPU per replica on CUDA. Elsewhere no CPU is reserved: the engine's device process
    is not Ray's to count, and a reserved core per replica would leave a small machine
    unable to place two."""
    resources = {"num_cpus": 1, "num_gpus": 1} if config.device == "cuda" else {"num_cpus": 0}
    return {**resources, "runtime_env": {"env_vars": REPLICA_ENV}}


def _engine_options(engine: EngineConfig | dict[str, Any] | None) -> dict[str, Any]:
    """Keyword arguments of ``EngineConfig``: they travel to the replicas as plain values."""
    if engine is None:
        return {}
    if isinstance(engine, EngineConfig):
        return {f.name: getattr(engine, f.name) for f in dataclasses.fields(EngineConfig)}
    return dict(engine)
