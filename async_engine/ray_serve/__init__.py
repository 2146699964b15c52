"""The engine as a Ray Serve application (``pip install 'async-engine[ray]'``).

- ``app.build_app``: the application of an engine config (replicas or autoscaling, the
  default or the prefix-affinity router); ``builder.app`` for ``serve run``;
- ``launch.start_replicas``: K replicas started on this machine, their URL and a stop;
- ``replica``/``serving``: the deployment, one ``AsyncEngine`` per replica;
- ``coalesce``/``asgi``: streamed events paced so that each Ray message carries the tokens
  made meanwhile; ``tunnel``/``ingress``: the ingress layout of the prefix-affinity router.

Importing this package does not import Ray: its modules do. ``require_ray`` says what to
install when it is missing, and the names below load on first use.
"""

from __future__ import annotations

from typing import Any

INSTALL_HINT = "pip install 'async-engine[ray]'"
_LAZY = {
    "build_app": "async_engine.ray_serve.app",
    "Autoscaling": "async_engine.ray_serve.app",
    "start_replicas": "async_engine.ray_serve.launch",
    "ReplicaOptions": "async_engine.ray_serve.serving",
}


class RayMissingError(RuntimeError):
    """Ray Serve is not importable here."""


def require_ray() -> None:
    """Raise ``RayMissingError`` naming the install command unless Ray Serve imports."""
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        raise RayMissingError(f"Ray Serve is not installed ({exc}): {INSTALL_HINT}") from None


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require_ray()
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
