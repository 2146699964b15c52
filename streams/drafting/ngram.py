"""Prompt lookup: the longest recent suffix of a row's tokens (``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens) is looked up earlier in the same row, and the tokens that
followed its latest earlier occurrence are the draft. Agent traffic quotes itself (tool calls
re-quote JSON, code and earlier turns), so these drafts are often right, for free.

A model device drafts on the device itself (``propose_on_device``), from its own copy of the
rows' tokens, inside the step: a verify step then needs no token on the host, so it is
launched before the step before it has ended. The simulated device, which loads no torch,
runs the numpy twin (``propose``); tests hold the two equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class NgramDrafter:
    drafts_on_device = True  # a model runner calls propose_on_device, not propose

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

    def propose_on_device(
        self, history: torch.Tensor, lengths: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``lookup`` for every row at once, in ops of fixed shapes (no host sync): rows'
        tokens ``history`` [V, H] (int, the first ``lengths`` [V] of each row meaningful).
        Returns the drafts [V, k] (int64, 0 past each row's count) and their counts [V]."""
        import torch

        rows, width = history.shape
        at = torch.arange(width, device=history.device)
        ends = lengths.unsqueeze(1) - 1  # [V, 1]: each row's last position
        # A candidate j is an earlier position holding the last token; it stays one while the
        # tokens before it match those before the last, one step back at a time.
        alive = at.unsqueeze(0) < ends
        matched = torch.zeros(rows, width, dtype=torch.int64, device=history.device)
        for back in range(min(self.max, width)):  # no candidate is further back than that
            want = history.gather(1, (ends - back).clamp(min=0))
            have = (
                history
                if back == 0
                else torch.nn.functional.pad(history[:, :-back], (back, 0), value=-1)
            )
            alive &= (have == want) & (ends - back >= 0)
            matched += alive
        # The longest match of at least min tokens, the latest of those.
        score = torch.where(matched >= self.min, matched * width + at, -1).amax(dim=1)
        end = score.clamp(min=0) % width
        count = torch.where(score >= 0, (lengths - 1 - end).clamp(max=k), 0)
        steps = torch.arange(k, device=history.device)
        drafts = history.gather(1, (end.unsqueeze(1) + 1 + steps).clamp(max=width - 1)).long()
        return torch.where(steps < count.unsqueeze(1), drafts, 0), count
