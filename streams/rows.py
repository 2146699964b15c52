"""Device-side row state: block tables and last sampled tokens, kept between steps.

Every device applies a plan's changes here first (released rows, new rows, table resets,
appended blocks), then asks for the flat arrays its forward pass needs. All of it is numpy,
so a step of hundreds of requests costs tens of microseconds, not a Python loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streams.plan import PLACEHOLDER, StepPlan


@dataclass(slots=True)
class BatchLayout:
    """Per-token arrays of one step, derived from the plan and the row state."""

    token_rows: np.ndarray  # int64 [T]: row of each input token
    positions: np.ndarray  # int64 [T]
    kv_slots: np.ndarray  # int64 [T]: block * block_size + offset
    context_lens: np.ndarray  # int64 [B]: tokens in each request's KV after the step
    block_tables: np.ndarray  # int64 [B, W]: padded with 0, W = most blocks in the batch


class RowState:
    def __init__(self, block_size: int, max_blocks_per_row: int, rows: int = 64) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks_per_row
        self.tables = np.zeros((rows, max_blocks_per_row), dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.last_tokens = np.zeros(rows, dtype=np.int64)  # the token buffer, host side
        self.live = np.zeros(rows, dtype=bool)

    def apply(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bring the row state up to the plan: releases, joins, resets, appended blocks.
        Returns the table entries written, as (rows, columns, blocks), for a device copy."""
        if len(plan.released_rows):
            self.live[plan.released_rows] = False
            self.num_blocks[plan.released_rows] = 0
        for new in plan.new_rows:
            self._ensure(new.row)
            self.live[new.row] = True
            self.num_blocks[new.row] = 0
        if len(plan.reset_rows):
            self.num_blocks[plan.reset_rows] = 0
        pairs = plan.new_blocks
        if len(pairs):
            return self.append_blocks(pairs[0::2].astype(np.int64), pairs[1::2].astype(np.int64))
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty

    def append_blocks(
        self, rows: np.ndarray, blocks: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Append blocks to rows' tables, in the order given (a row may appear many times)."""
        order = np.argsort(rows, kind="stable")
        rows, blocks = rows[order], blocks[order]
        # Rank of each pair within its row's run: index minus the run's first index.
        first = np.r_[0, np.flatnonzero(rows[1:] != rows[:-1]) + 1]
        run_lengths = np.diff(np.r_[first, len(rows)])
        rank = np.arange(len(rows)) - np.repeat(first, run_lengths)
        columns = self.num_blocks[rows] + rank
        if (columns >= self.max_blocks).any():
            raise ValueError(f"a block table outgrew {self.max_blocks} blocks")
        self.tables[rows, columns] = blocks
        self.num_blocks[rows[first]] += run_lengths
        return rows, columns, blocks

    def layout(self, plan: StepPlan) -> BatchLayout:
        rows = plan.rows.astype(np.int64)
        qlens = plan.query_lens.astype(np.int64)
        starts = plan.starts.astype(np.int64)
        ends = starts + qlens
        token_rows = np.repeat(rows, qlens)
        # Position of each token: its row's start plus its index within the row's run.
        first = np.cumsum(qlens) - qlens
        positions = np.repeat(starts - first, qlens) + np.arange(len(token_rows))
        bs = self.block_size
        block_index = positions // bs
        if (block_index >= self.num_blocks[token_rows]).any():
            raise ValueError("a plan reads past the end of a row's block table")
        blocks = self.tables[token_rows, block_index]
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        return BatchLayout(
            token_rows=token_rows,
            positions=positions,
            kv_slots=blocks * bs + positions % bs,
            context_lens=ends,
            block_tables=self.tables[rows, : max(width, 1)],
        )

    def input_ids(self, plan: StepPlan, token_rows: np.ndarray) -> np.ndarray:
        """The plan's inputs with PLACEHOLDERs filled from the host-side token buffer."""
        ids = plan.input_ids.astype(np.int64)
        carried = ids == PLACEHOLDER
        if carried.any():
            ids[carried] = self.last_tokens[token_rows[carried]]
        return ids

    def record_sampled(self, plan: StepPlan, tokens: np.ndarray) -> None:
        self.last_tokens[plan.rows[plan.sample]] = tokens

    def table(self, row: int) -> list[int]:
        return self.tables[row, : self.num_blocks[row]].tolist()

    def _ensure(self, row: int) -> None:
        if row < len(self.live):
            return
        grow = max(2 * len(self.live), row + 1)
        for name in ("tables", "num_blocks", "last_tokens", "live"):
            old = getattr(self, name)
            new = np.zeros((grow, *old.shape[1:]), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
