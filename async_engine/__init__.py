"""async-engine: an LLM serving engine whose control plane never makes the device wait.

Names are resolved lazily so that the device process, which imports
``async_engine.model``, never pays for (or imports) asyncio, gRPC or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestDelta"]

_LAZY = {
    "LLM": "async_engine.core.llm",
    "RequestOutput": "async_engine.core.llm",
    "AsyncEngine": "async_engine.core.engine",
    "RequestDelta": "async_engine.core.output",
    "EngineConfig": "async_engine.core.config",
    "SamplingParams": "sampler.params",
}

if TYPE_CHECKING:
    from async_engine.core.config import EngineConfig
    from async_engine.core.engine import AsyncEngine
    from async_engine.core.llm import LLM, RequestOutput
    from async_engine.core.output import RequestDelta
    from sampler.params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'async_engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
