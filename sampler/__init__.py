"""Sampling settings and the batched sampler; depends only on torch and the stdlib.

``SamplingParams`` needs no torch: a process that only unpickles plans (the simulated
device) must not pay a second of importing it, so the sampler loads on first use.
"""

from typing import Any

from sampler.params import MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "Positions", "Sample", "Sampler", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("Positions", "Sample", "Sampler"):
        from sampler import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module 'sampler' has no attribute {name!r}")
