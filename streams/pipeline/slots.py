"""Pinned slots: a step's flat int64 arrays go to the device packed into one, and its sampled
tokens and logprobs come back into it. The runner reuses a slot only after the step that
used it was finished, so every staging area in it is safe to overwrite."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from streams.pipeline.devsync import DeviceSync
from streams.plan import DRAFT
from streams.rows import StepLayout

MAX_TOP = 20  # top logprobs a row may ask for (sampler.params.MAX_LOGPROBS)
# Each section starts on a 16-byte boundary (two int64s): Triton specialises a kernel on
# whether each pointer is 16-byte aligned, so sections at any offset would compile a variant
# per alignment pattern while serving.
ALIGN = 2
# Where the device's drafter works, and the chains a host drafter drafted ahead.
DEVICE_DRAFT_SECTIONS = (
    "draft_rows",
    "draft_runs",
    "draft_to",
    "draft_from",
    "chain_tokens",
    "chain_lengths",
    "chain_base",
)
# The flat int64 arrays of one step, packed back to back into one pinned slot.
SECTIONS = (
    "input_ids",
    "token_slots",
    "positions",
    "kv_slots",
    "rows",
    "context_lens",
    "q_starts",
    "q_lens",
    "logits_indices",
    "sample_rows",
    "sample_slots",
    "sample_offsets",
    "sample_runs",
    "run_rows",
    "drafted",
    "score_targets",
    "drafts_at",
    "drafts_input",
    *DEVICE_DRAFT_SECTIONS,
    "starts",
    "resolve",
    "delta_rows",
    "delta_cols",
    "delta_blocks",
)


def step_sections(
    layout: StepLayout,
    delta: tuple[np.ndarray, ...],
    token_slots: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> dict[str, np.ndarray]:
    """A step's flat arrays by section: its layout's and its block-table change.
    ``token_slots(rows, positions)``: where the token buffer keeps a row's token at a position."""
    at = layout.sample_index
    empty = np.zeros(0, np.int64)
    sampled = layout.num_sampled > 0
    offsets, runs, drafted, drafts_at, drafts_input = empty, empty, empty, empty, empty
    if layout.verifying:
        offsets, drafted = layout.sample_offsets, layout.drafted
        runs = np.repeat(np.arange(len(drafted)), layout.num_sampled[sampled])
        drafts_at, drafts_input = _drafts_before(layout)
    starts = resolve = empty
    if layout.resolve_on_device is not None:
        starts, resolve = layout.starts, layout.resolve_on_device
    return {
        "input_ids": layout.input_ids,
        "token_slots": token_slots(layout.token_rows, layout.positions),
        "positions": layout.positions,
        "kv_slots": layout.kv_slots,
        "rows": layout.rows,
        "context_lens": layout.context_lens,
        "q_starts": np.cumsum(layout.query_lens) - layout.query_lens,
        "q_lens": layout.query_lens,
        # The sampled inputs' logits, then the prompt positions' a row asked to score.
        "logits_indices": at
        if layout.scores is None
        else np.concatenate((at, layout.scores.index)),
        "score_targets": empty if layout.scores is None else layout.scores.targets,
        "sample_rows": layout.sample_rows,
        # A sampled token is the row's token at the position after its input's.
        "sample_slots": token_slots(layout.sample_rows, layout.positions[at] + 1),
        "sample_offsets": offsets,
        "sample_runs": runs,
        "run_rows": layout.rows[sampled],
        "drafted": drafted,
        "drafts_at": drafts_at,
        "drafts_input": drafts_input,
        **_device_drafts(layout),
        "starts": starts,
        "resolve": resolve,
        "delta_rows": delta[0],
        "delta_cols": delta[1],
        "delta_blocks": delta[2],
    }


def packed_length(sections: dict[str, np.ndarray]) -> int:
    """The ints ``Slot.pack`` takes for these sections, alignment padding included."""
    return sum(_aligned(len(values)) for values in sections.values())


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _drafts_before(layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
    """(sampled position, input) for every draft that precedes a sampled position in its
    row's run: penalties count it there, as decoding would have by then (the input's token
    is read on the device, where the drafts may be made)."""
    pairs_at, pairs_input = [], []
    index = layout.sample_index
    runs = layout.num_sampled[layout.num_sampled > 0].tolist()
    firsts = np.flatnonzero(layout.sample_offsets == 0).tolist()
    for first, n in zip(firsts, runs, strict=True):
        for j in range(1, n):  # position first + j follows the drafts at inputs 1..j
            for i in range(1, j + 1):
                pairs_at.append(first + j)
                pairs_input.append(int(index[first] + i))
    return np.array(pairs_at, np.int64), np.array(pairs_input, np.int64)


def _device_drafts(layout: StepLayout) -> dict[str, np.ndarray]:
    """Where the device's drafter works: the drafting rows, each one's run among the sampled
    rows, the DRAFT inputs, and for each the flat index of its draft in the drafter's
    [rows, most slots] output; and the chains drafted ahead on the host, if any (flat)."""
    empty = np.zeros(0, np.int64)
    chains = layout.chains
    if not layout.drafts_on_device:
        return dict.fromkeys(DEVICE_DRAFT_SECTIONS, empty)
    slots = layout.num_sampled[layout.num_sampled > 0] - 1
    drafting = np.flatnonzero(slots > 0)
    counts = slots[drafting]
    first = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum())) - np.repeat(first, counts)
    return {
        "draft_rows": layout.rows[layout.num_sampled > 0][drafting],
        "draft_runs": drafting,
        "draft_to": np.flatnonzero(layout.input_ids == DRAFT),
        "draft_from": np.repeat(np.arange(len(drafting)) * int(counts.max()), counts) + within,
        "chain_tokens": empty if chains is None else chains.tokens.reshape(-1),
        "chain_lengths": empty if chains is None else chains.lengths,
        "chain_base": empty if chains is None else chains.base,
    }


@dataclass(slots=True)
class Slot:
    """Buffers of one step in flight; grown (never shrunk) while the slot is free."""

    host_in: torch.Tensor  # pinned int64: the packed sections
    dev_in: torch.Tensor  # the device's copy of it
    tokens: torch.Tensor  # pinned int64 [S]
    counts: torch.Tensor  # pinned int64 [S]: tokens each sampled row emits (a verify step)
    drafted: torch.Tensor  # pinned int64 [S]: drafts each sampled row verified
    logprobs: torch.Tensor  # pinned float32 [S]
    top_ids: torch.Tensor  # pinned int64 [S * MAX_TOP]
    top_values: torch.Tensor  # pinned float32 [S * MAX_TOP]

    def pack(self, sections: dict[str, np.ndarray]) -> dict[str, tuple[int, int]]:
        """Write the sections into the pinned input, each at an ALIGN boundary; where each
        one lies (``packed_length`` ints in all)."""
        packed = self.host_in.numpy()
        offsets, at = {}, 0
        for name in SECTIONS:
            values = sections[name]
            packed[at : at + len(values)] = values
            offsets[name] = (at, at + len(values))
            at += _aligned(len(values))
        return offsets

    def top_lists(
        self, count: int, top: int, wanted: list[int | None]
    ) -> list[list[tuple[int, float]]]:
        """Each emitted token's top logprobs, trimmed to the number its row asked for."""
        ids = self.top_ids[: count * top].view(count, top).tolist() if top else []
        values = self.top_values[: count * top].view(count, top).tolist() if top else []
        return [
            list(zip(ids[i][:n], values[i][:n], strict=True)) if n else []
            for i, n in enumerate(wanted)
        ]


@dataclass(slots=True)
class Pending:
    """A launched step: what ``finish`` needs to turn it into a StepResult."""

    step_id: int
    slot: Slot
    num_tokens: int  # tokens copied out: every sampled position's
    top: int  # top logprobs copied per token
    wanted: list[int | None]  # each sampled position's row's logprobs setting
    has_logprobs: bool
    start: Any  # events: compute began the step, sampling ended, tokens reached the host
    end: Any
    copied: Any
    keep: tuple  # device tensors the D2H copy reads: alive until it is done
    layout: StepLayout
    # int32: tokens each sampled row emits; None where the device decided them (a verify
    # step: they come back in the slot with the tokens)
    counts: np.ndarray | None
    joined: np.ndarray  # the requests its sampled rows held (``RowState.joined``)
    # Prompt logprobs the step scored (device tensors: logprob, rank, top ids, top logprobs).
    scores: tuple | None = None


def new_slot(sync: DeviceSync, device: torch.device, ints: int, sampled: int) -> Slot:
    """A slot for ``ints`` packed int64s and ``sampled`` sampled rows."""
    pin = sync.pinned
    return Slot(
        host_in=pin(ints, torch.int64),
        # Not zeroed: a step's copy writes what it reads, and a zero-fill issued on this
        # thread's stream could land after the H2D stream's copy into it.
        dev_in=torch.empty(ints, dtype=torch.int64, device=device),
        tokens=pin(sampled, torch.int64),
        counts=pin(sampled, torch.int64),
        drafted=pin(sampled, torch.int64),
        logprobs=pin(sampled, torch.float32),
        top_ids=pin(sampled * MAX_TOP, torch.int64),
        top_values=pin(sampled * MAX_TOP, torch.float32),
    )


def fit_slot(sync: DeviceSync, device: torch.device, slot: Slot, ints: int, sampled: int) -> Slot:
    """The slot, regrown when this step's arrays outgrow it (doubling: rare)."""
    if ints <= slot.host_in.numel() and sampled <= slot.tokens.numel():
        return slot
    return new_slot(
        sync, device, max(ints, 2 * slot.host_in.numel()), max(sampled, 2 * slot.tokens.numel())
    )
