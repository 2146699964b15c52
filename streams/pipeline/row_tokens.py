"""Each row's tokens and their count, on the device, for rows that speculate.

A verify step's emitted counts are decided on the device (``streams.pipeline.speculation``),
and the host learns them only when the step's tokens come back. Steps launched before then
need two things the host does not have yet: where each such row's next query starts (its
count, ``length``) and, to draft on the device, the row's tokens (``history``). Both are
written on the compute stream by the step that samples the tokens, so every later step
reads them in order.
"""

from __future__ import annotations

import numpy as np
import torch

from streams.plan import NewRow


class RowTokens:
    def __init__(self, rows: int, device: torch.device) -> None:
        self.device = device
        self.length = torch.zeros(rows, dtype=torch.int64, device=device)
        self.history = torch.zeros(rows, 256, dtype=torch.int32, device=device)

    def join(self, new_rows: list[NewRow]) -> None:
        """New rows hold their prompts (on the compute stream)."""
        if not new_rows:
            return
        lengths = np.array([len(n.prompt_ids) for n in new_rows], np.int64)
        self.widen(int(lengths.max()) + 1)
        rows = np.array([n.row for n in new_rows], np.int64)
        flat = np.concatenate([np.asarray(n.prompt_ids, np.int64) for n in new_rows])
        within = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        at = np.repeat(rows, lengths) * self.history.shape[1] + within
        packed = _to_device(
            torch.from_numpy(np.concatenate([rows, lengths, flat, at])), self.device
        )
        n, m = len(rows), len(flat)
        self.length.index_copy_(0, packed[:n], packed[n : 2 * n])
        self.history.view(-1).index_copy_(0, packed[2 * n + m :], packed[2 * n : 2 * n + m].int())

    def fit(self, rows: int) -> None:
        """Room for ``rows`` rows."""
        have = self.length.shape[0]
        if rows > have:
            self.length = torch.cat([self.length, self.length.new_zeros(rows - have)])
            self.history = torch.cat(
                [self.history, self.history.new_zeros(rows - have, self.history.shape[1])]
            )

    def widen(self, width: int) -> None:
        """Room for ``width`` tokens a row (doubling)."""
        have = self.history.shape[1]
        if width > have:
            wider = max(width, 2 * have)
            grown = self.history.new_zeros(self.history.shape[0], wider)
            grown[:, :have] = self.history
            self.history = grown

    def record(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        run_rows: torch.Tensor,
        counts: torch.Tensor,
    ) -> None:
        """A step sampled ``tokens`` [S] for ``rows`` [S] at ``positions`` [S] (each the
        position of the token it follows); each sampled row (``run_rows`` [R]) emitted
        ``counts`` [R] of them, its first. Tokens past a row's count are written too: they
        lie past its length, where the row's next tokens overwrite them."""
        flat = rows * self.history.shape[1] + positions + 1
        self.history.view(-1).index_copy_(0, flat, tokens.int())
        self.length.index_add_(0, run_rows, counts)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # Pinned, so the copy is queued on the stream instead of waiting for it.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
