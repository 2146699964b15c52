"""The handoff contract between the scheduler and every device: incremental, flat plans.

Words: a *row* is a request's place on the device (its token buffer, its block table and
its sampling state), held from admission until the request's blocks are freed; a *block*
is a run of ``block_size`` KV positions; a *KV slot* is one such position
(``block * block_size + offset``).

A plan carries only what changed: per request in the batch its row, where its query
starts, how many tokens it computes now and how many of its last ones are sampled; rows
that join, leave or start their block table over; and blocks appended to block tables.
The device keeps each row's block table and its tokens between steps and derives
positions, KV slots and context lengths itself. Everything per request or per token
travels as a flat numpy array.

Several tokens a row: a row may verify drafts. Its last inputs are then DRAFT slots, which
the device fills with tokens its drafter proposes (or drops, if it has fewer); every
position from the row's last real token on is sampled (``num_sampled`` = 1 + slots), and
the row emits its longest verified run of tokens plus one. How many it emitted is known to
the device first, so a later step that continues such a row before the control plane has
seen the result says RESOLVE for its start: the device starts it where its own count of
the row's tokens ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Input ids: PLACEHOLDER is "this row's token at this position", which a step before sampled
# (the device reads it from its token buffer, so the control plane never waits for it);
# DRAFT is "a token the device's drafter proposes here".
PLACEHOLDER = -1
DRAFT = -2
# A start: "where the device's count of the row's tokens ends, less one" (the row's last
# token is the query's first).
RESOLVE = -1


def int32s(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def int64s(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


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
    starts: np.ndarray  # int32 [B]: the row's tokens already in the KV cache, or RESOLVE
    query_lens: np.ndarray  # int32 [B]: tokens computed now (positions start..start+n-1)
    num_sampled: np.ndarray  # int32 [B]: 0 (a chunk short of the end), 1, or 1 + DRAFT slots
    input_ids: np.ndarray  # int64 [T], T = sum(query_lens); PLACEHOLDER, DRAFT
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
    # Control-plane side only, never sent: the scheduler's requests, in batch order, and
    # (where the scheduler had them at hand) their output and token-time lists.
    requests: list[Any] = field(default_factory=list)
    lists: tuple[list, list] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def sampled(self) -> np.ndarray:
        """bool [B]: whether the row samples at all this step."""
        return self.num_sampled > 0

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, f) for f in _WIRE_FIELDS)

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(_WIRE_FIELDS, state, strict=True):
            setattr(self, name, value)
        self.requests, self.lists = [], None


_WIRE_FIELDS = tuple(f for f in StepPlan.__slots__ if f not in ("requests", "lists"))


# A row's prompt logprobs scored in a step: (row, first position, logprob of the prompt
# token after each position, its rank, the top-n (id, logprob) at each position).
PromptLogprobs = tuple[int, int, list[float], list[int], list[list[tuple[int, float]]]]


@dataclass(slots=True)
class StepResult:
    """What the device sends back for one step: each sampled row's tokens, in batch order."""

    step_id: int
    tokens: np.ndarray | list[int]  # the tokens every sampled row emits, back to back
    logprobs: list[float] | None = None  # logprob of each emitted token (when asked)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per emitted token
    device_start: float = 0.0  # time.monotonic() when the device began the step
    device_end: float = 0.0
    error: str | None = None
    # Per sampled row: tokens it emitted, drafts it verified. Empty: one each, none.
    counts: np.ndarray = field(default_factory=_no_rows)
    drafted: np.ndarray = field(default_factory=_no_rows)
    prompt_logprobs: list[PromptLogprobs] | None = None  # rows that asked, when scored

    def emitted(self, num_rows: int) -> np.ndarray:
        """int32 [num_rows]: how many tokens each sampled row emitted."""
        if len(self.counts):
            return self.counts
        return np.ones(num_rows, np.int32)
