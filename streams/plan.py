"""The handoff contract between the scheduler (plain ints and lists) and the device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# An input token equal to PLACEHOLDER means "the token the previous step sampled for this
# request": the device reads it from its token buffer, so the CPU never waits for it.
PLACEHOLDER = -1


@dataclass(slots=True)
class NewSlot:
    """A request that takes a device slot: its sampling settings travel once, not every step."""

    slot: int
    params: Any  # sampler.SamplingParams
    prompt_ids: list[int]
    stop_ids: list[int]  # suppressed while fewer than min_tokens were generated


@dataclass(slots=True)
class StepPlan:
    step_id: int
    request_ids: list[str]
    slots: list[int]  # device slot of each request (its row in the token buffer)
    query_lens: list[int]  # tokens computed for each request in this step
    context_lens: list[int]  # tokens in the KV cache of each request after this step
    input_ids: list[int]  # flattened over requests; PLACEHOLDER = take from token buffer
    positions: list[int]
    slot_mapping: list[int]  # KV cache slot of each input token: block * block_size + offset
    block_tables: list[list[int]]
    sample: list[bool]  # whether a token is sampled for each request
    new_slots: list[NewSlot] = field(default_factory=list)
    released_slots: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.sample)


@dataclass(slots=True)
class StepResult:
    """What the device sends back for one step."""

    step_id: int
    tokens: list[int]  # one per sampled request, in plan order
    logprobs: list[float] | None = None  # logprob of each sampled token (when asked)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per sampled request
    device_start: float = 0.0  # time.monotonic() when the device began the step
    device_end: float = 0.0
    error: str | None = None
