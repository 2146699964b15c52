"""Which of a step's sampled tokens its rows emit: for a row that verified drafts, the
longest run of sampled tokens that each equal the draft after them, plus one more.

A position's sampled token is what one-at-a-time decoding would sample there (the sampler
gives each its own output index), so a draft that equals it is exactly the token decoding
would have produced, and the first that does not is replaced by what decoding produces
instead. For a greedy row that is the longest prefix equal to the argmax; for a sampled row
it is speculative sampling with the draft as a point mass (q = one-hot): a draft d is kept
with probability p(d), and on rejection the token is drawn from p without d, renormalised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def emitted_counts(
    tokens: np.ndarray, next_drafts: np.ndarray, offsets: np.ndarray, num_sampled: np.ndarray
) -> np.ndarray:
    """int32 [rows]: tokens each sampled row emits. ``tokens``, ``next_drafts`` and ``offsets``
    are per sampled position (rows' runs back to back), ``num_sampled`` per sampled row."""
    miss = tokens != next_drafts  # a run's last position never matches (its draft is -1)
    run = np.repeat(np.arange(len(num_sampled)), num_sampled)
    first_miss = np.full(len(num_sampled), np.iinfo(np.int64).max)
    np.minimum.at(first_miss, run[miss], offsets[miss])
    return (first_miss + 1).astype(np.int32)


def keep_emitted(offsets: np.ndarray, num_sampled: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """bool [positions]: the sampled positions whose token a row emits."""
    return offsets < np.repeat(counts, num_sampled)


# The same rule in torch ops of fixed shapes, for a model device: no host sync, so a GPU
# runs it inside the step. (The simulated device runs the numpy twin above and loads no
# torch; tests/test_handoff_protocol.py holds the two equal.)
def counts_of_runs(
    tokens: torch.Tensor, next_drafts: torch.Tensor, offsets: torch.Tensor, runs: torch.Tensor,
    num_runs: int,
) -> torch.Tensor:  # fmt: skip
    """int64 [num_runs]: tokens each sampled row emits, from per-position tokens, drafts after
    them (-1: none), offsets in their runs and their runs' indices (all on one device)."""
    import torch

    never = torch.iinfo(torch.int64).max
    first_miss = torch.full((num_runs,), never, dtype=torch.int64, device=tokens.device)
    missed = torch.where(tokens != next_drafts, offsets, never)
    return first_miss.scatter_reduce_(0, runs, missed, "amin") + 1


def kept_of_runs(offsets: torch.Tensor, runs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool [positions]: the sampled positions whose token a row emits (device tensors)."""
    return offsets < counts[runs]
