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

import numpy as np


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
