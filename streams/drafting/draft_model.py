"""Drafting with a smaller model of the target's tokenizer, in the device process, on a paged
KV cache of its own.

Each row's cache holds the tokens the draft model last read for it; a proposal first feeds
what the row has since (from where those still agree with the row's tokens: drafts the
target rejected are overwritten), then decodes greedily, one token at a time, for all rows
at once. Greedy drafts are point masses, which verification treats exactly (``streams.verify``).
A row the cache has no blocks for gets no draft this step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from streams.batch import ForwardBatch
from streams.drafting.config import SpeculativeConfig


class ModelDrafter:
    def __init__(
        self,
        config: SpeculativeConfig,
        model_factory: Callable[[], Any],
        device: str,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        self.model = model_factory()
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.kv_cache = self.model.allocate_kv_cache(num_blocks, block_size)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}  # row -> its blocks
        self._read: dict[int, list[int]] = {}  # row -> the tokens whose KV its blocks hold
        self._sure: dict[int, int] = {}  # row -> how many of them are the row's own tokens

    def release(self, row: int, tokens: np.ndarray) -> None:
        self._free += self._tables.pop(row, [])
        self._read.pop(row, None)
        self._sure.pop(row, None)

    @torch.inference_mode()
    def propose(self, rows: list[int], tokens: list[np.ndarray], ks: list[int]) -> list[np.ndarray]:
        drafts: list[list[int]] = [[] for _ in rows]
        # First: what each row has that the draft model has not read (at least its last token).
        feeds, live = [], []
        for i, (row, seq, k) in enumerate(zip(rows, tokens, ks, strict=True)):
            read, sure = self._read.get(row, []), self._sure.get(row, 0)
            # Only what it read past the tokens known to be the row's can differ (drafts).
            agree = sure + _common_prefix(read[sure:], seq[sure : len(read)].tolist())
            agree = min(agree, len(seq) - 1)  # the last token is fed again: its logits
            self._sure[row] = agree
            if k <= 0 or not self._room(row, len(seq) + k - 1):
                continue
            self._read[row] = read[:agree]
            feeds.append((row, seq[agree:].tolist(), agree))
            live.append(i)
        if not feeds:
            return [np.zeros(0, np.int64) for _ in rows]
        last = self._step(feeds)
        for i, token in zip(live, last, strict=True):
            drafts[i].append(token)
        # Then one token at a time, for the rows that want more.
        for j in range(1, max(ks)):
            step = [(i, rows[i]) for i in live if ks[i] > j]
            if not step:
                break
            feeds = [(row, [drafts[i][-1]], len(self._read[row])) for i, row in step]
            for (i, _), token in zip(step, self._step(feeds), strict=True):
                drafts[i].append(token)
        return [np.array(d, np.int64) for d in drafts]

    def _room(self, row: int, tokens: int) -> bool:
        """Blocks for ``tokens`` positions of the row (False: the cache is full)."""
        table = self._tables.setdefault(row, [])
        need = -(-tokens // self.block_size) - len(table)
        if need > len(self._free) or len(table) + need > self.max_blocks:
            return False
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        return True

    def _step(self, feeds: list[tuple[int, list[int], int]]) -> list[int]:
        """Feed each (row, tokens, start) at positions start..; the greedy next token of each."""
        ids, positions, slots, qlens, ctx = [], [], [], [], []
        bs = self.block_size
        for row, new, start in feeds:
            table = self._tables[row]
            for offset, token in enumerate(new):
                position = start + offset
                ids.append(token)
                positions.append(position)
                slots.append(table[position // bs] * bs + position % bs)
            qlens.append(len(new))
            ctx.append(start + len(new))
            self._read[row] = self._read[row] + new
        width = max(len(self._tables[row]) for row, _, _ in feeds)
        tables = torch.zeros(len(feeds), width, dtype=torch.int64)
        for i, (row, _, _) in enumerate(feeds):
            tables[i, : len(self._tables[row])] = torch.tensor(self._tables[row])
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens=qlens,
            context_lens=ctx,
            block_tables=tables.to(dev),
            logits_indices=torch.tensor(np.cumsum(qlens) - 1, dtype=torch.int64, device=dev),
        )
        logits = self.model(batch, self.kv_cache)
        return logits.argmax(dim=-1).tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
