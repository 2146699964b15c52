"""The handoff contract between the scheduler and every device: incremental, flat plans.

Words: a *row* is a request's place on the device (its token-buffer entry, its block table
and its sampling state), held from admission until the request's blocks are freed; a
*block* is a run of ``block_size`` KV positions; a *KV slot* is one such position
(``block * block_size + offset``).

A plan carries only what changed: per request in the batch its row, how many tokens it
already has in the KV cache and how many it computes now; rows that join, leave or start
their block table over; and blocks appended to block tables. The device keeps each row's
block table between steps and derives positions, KV slots and context lengths itself.
Everything per request or per token travels as a flat numpy array.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# An input token equal to PLACEHOLDER means "the token the previous step sampled for this
# row": the device reads it from its token buffer, so the CPU never waits for it.
PLACEHOLDER = -1


def int32s(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def int64s(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def bools(values: list[bool]) -> np.ndarray:
    return np.array(values, dtype=bool)


def _no_rows() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


@dataclass(slots=True)
class NewRow:
    """A request that takes a row: its sampling settings travel once, not every step."""

    row: int
    params: Any  # sampler.SamplingParams
    prompt_ids: list[int]
    stop_ids: list[int]  # suppressed while fewer than min_tokens were generated


@dataclass(slots=True)
class StepPlan:
    step_id: int
    rows: np.ndarray  # int32 [B]: each request's row, in batch order
    starts: np.ndarray  # int32 [B]: tokens of the row already in the KV cache
    query_lens: np.ndarray  # int32 [B]: tokens computed now (positions start..start+n-1)
    sample: np.ndarray  # bool [B]: whether a token is sampled for the request
    input_ids: np.ndarray  # int64 [T], T = sum(query_lens); PLACEHOLDER = from the buffer
    new_rows: list[NewRow] = field(default_factory=list)
    released_rows: np.ndarray = field(
        default_factory=_no_rows
    )  # rows whose request left (applied first)
    reset_rows: np.ndarray = field(
        default_factory=_no_rows
    )  # rows whose block table starts over (preempted)
    new_blocks: np.ndarray = field(
        default_factory=_no_rows
    )  # int32 [2K]: (row, block) pairs, appended in order
    # Control-plane side only, never sent: the scheduler's requests, in batch order.
    requests: list[Any] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, f) for f in _WIRE_FIELDS)

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(_WIRE_FIELDS, state, strict=True):
            setattr(self, name, value)
        self.requests = []


_WIRE_FIELDS = tuple(f for f in StepPlan.__slots__ if f != "requests")


@dataclass(slots=True)
class StepResult:
    """What the device sends back for one step."""

    step_id: int
    tokens: np.ndarray | list[int]  # one per sampled request, in batch order
    logprobs: list[float] | None = None  # logprob of each sampled token (when asked)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per sampled request
    device_start: float = 0.0  # time.monotonic() when the device began the step
    device_end: float = 0.0
    error: str | None = None
