"""Fan-out rule: n > 1 samples run as children "<id>#<i>" with params.for_sample(i)."""

from __future__ import annotations

from sampler.params import SamplingParams

SEPARATOR = "#"


def child_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of a request's n samples, in index order (n == 1: the id)."""
    if n == 1:
        return [request_id]
    return [f"{request_id}{SEPARATOR}{i}" for i in range(n)]


def child_params(params: SamplingParams, n: int, index: int) -> SamplingParams:
    """Sample ``index``'s params: one sequence, seed + index (n == 1: the params)."""
    return params if n == 1 else params.for_sample(index)


def parent_id(child_id: str) -> str:
    """The request id of a child of an n > 1 request (the inverse of ``child_ids``)."""
    return child_id.rpartition(SEPARATOR)[0]
