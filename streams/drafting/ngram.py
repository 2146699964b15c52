"""Prompt lookup: the longest recent suffix of a row's tokens (``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens) is looked up earlier in the same row, and the tokens that
followed its latest earlier occurrence are the draft. Agent traffic quotes itself (tool calls
re-quote JSON, code and earlier turns), so these drafts are often right, for free."""

from __future__ import annotations

import numpy as np


class NgramDrafter:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min, self.max = prompt_lookup_min, prompt_lookup_max

    def propose(self, rows: list[int], tokens: list[np.ndarray], ks: list[int]) -> list[np.ndarray]:
        return [self.lookup(t, k) for t, k in zip(tokens, ks, strict=True)]

    def release(self, row: int, tokens: np.ndarray) -> None:
        pass  # each row looks only at itself

    def lookup(self, tokens: np.ndarray, k: int) -> np.ndarray:
        """The ``k`` tokens after the latest earlier occurrence of the longest suffix of
        ``tokens`` (between min and max long) found; empty if none is."""
        n = len(tokens)
        if n <= self.min or k <= 0:
            return tokens[:0].astype(np.int64)
        # Candidates: earlier positions holding the last token, then kept while the tokens
        # before them match too, one step back at a time (most suffixes fail at once).
        ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
        length = 1
        best = ends if len(ends) and self.min <= 1 else None
        while len(ends) and length < self.max:
            before = ends - length
            kept = before >= 0
            ends, before = ends[kept], before[kept]
            ends = ends[tokens[before] == tokens[n - 1 - length]]
            if not len(ends):
                break
            length += 1
            if length >= self.min:
                best = ends
        if best is None:
            return tokens[:0].astype(np.int64)
        start = int(best[-1]) + 1  # after the latest occurrence
        return tokens[start : start + k].astype(np.int64)
