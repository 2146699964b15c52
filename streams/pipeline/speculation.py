"""The device's part of speculative decoding, issued on the compute stream with no host sync:
starts where a row's last verified run ended, drafts from the rows' own tokens, and which
sampled tokens each row emits.

Why on the device: a verify step's emitted counts decide where its rows' next queries start
and what their drafts follow. Were they decided on the host, every verify step would wait
for its own tokens and the next one for all of them, and the device would idle between
them. Here a step is laid out on the host from the least each row can hold (one token a
step), and ``resolve_starts`` moves the rows the host cannot know yet to where the device's
count (``RowTokens.length``) ends; ``draft`` fills DRAFT inputs from the device's copy of
the rows' tokens; ``verify`` compares each sampled token with the draft after it. The host
learns the counts when the step's tokens come back.
"""

from __future__ import annotations

import torch

from streams.pipeline.row_tokens import RowTokens
from streams.rows import StepLayout
from streams.verify import counts_of_runs, kept_of_runs


def resolve_starts(
    dev: dict[str, torch.Tensor],
    tokens: RowTokens,
    tables: torch.Tensor,
    block_size: int,
    window: int,
    num_sampled: int,
) -> None:
    """In place: the flagged rows' (``dev["resolve"]``) positions, KV slots, token-buffer
    slots and context lengths, moved from the host's starts to the device's counts.
    ``window``: positions a row's token buffer holds; ``num_sampled``: sampled positions."""
    rows, q_lens = dev["rows"], dev["q_lens"]
    count = dev["positions"].shape[0]
    shift = (tokens.length.index_select(0, rows) - 1 - dev["starts"]) * dev["resolve"]
    positions = dev["positions"]
    positions += shift.repeat_interleave(q_lens, output_size=count)
    token_rows = rows.repeat_interleave(q_lens, output_size=count)
    blocks = tables[token_rows, torch.div(positions, block_size, rounding_mode="floor")]
    dev["kv_slots"].copy_(blocks * block_size + positions % block_size)
    dev["token_slots"].copy_(token_rows * window + positions % window)
    dev["context_lens"] += shift
    sampled_at = positions.index_select(0, dev["logits_indices"][:num_sampled])
    dev["sample_slots"].copy_(dev["sample_rows"] * window + (sampled_at + 1) % window)


def draft(
    dev: dict[str, torch.Tensor], tokens: RowTokens, drafter: object, most: int, width: int
) -> torch.Tensor:
    """Fill the DRAFT inputs from ``drafter.propose_on_device`` over the drafting rows'
    tokens (``width``: at most this many a row, a bound the host knows); returns how many
    drafts each sampled row got (int64 [sampled rows]), at most its slots
    (``dev["drafted"]``)."""
    rows = dev["draft_rows"]
    history = tokens.history[:, :width].index_select(0, rows)
    proposed, found = drafter.propose_on_device(history, tokens.length.index_select(0, rows), most)
    dev["input_ids"].index_copy_(0, dev["draft_to"], proposed.view(-1)[dev["draft_from"]])
    drafted = torch.zeros_like(dev["run_rows"]).index_copy_(0, dev["draft_runs"], found)
    return torch.minimum(drafted, dev["drafted"])


def verify(
    dev: dict[str, torch.Tensor], layout: StepLayout, sampled: torch.Tensor, drafted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sampled row's emitted count (int64 [rows]) and which sampled positions it emits
    (bool [positions]): a run goes on while the token sampled at a position equals the
    draft after it, up to the row's ``drafted`` drafts."""
    ids, at, offsets, runs = (
        dev["input_ids"], dev["logits_indices"], dev["sample_offsets"], dev["sample_runs"]
    )  # fmt: skip
    following = ids.index_select(0, (at[: len(sampled)] + 1).clamp(max=ids.shape[0] - 1))
    next_drafts = torch.where(offsets < drafted.index_select(0, runs), following, -1)
    counts = counts_of_runs(sampled, next_drafts, offsets, runs, len(layout.drafted))
    return counts, kept_of_runs(offsets, runs, counts)
