"""Decode and verify steps through static buffers in padded buckets: CUDA graphs on a GPU,
eager on CPU.

A captured graph replays fixed kernels on fixed addresses, so a step whose every row samples
every token it runs (a decode: one token a row; a verify: its last token and its drafts)
runs in the smallest bucket (b, q) with b >= its rows and q >= its longest row: the live
tokens are copied into the static buffers, row i's at i * q onward, and the rest is padding
that writes only a reserved dummy block (its KV slot; its block-table columns past a row's
own). A row shorter than q is padded at its end: its context counts the padding, so each
real token attends exactly what it would unpadded and only padding sees past it; padding
rows have a context of q tokens of the dummy block. Padding's logits are computed and never
read. Without capture (a CPU, ``--cuda-graphs off``) the same buffers run eagerly, which is
what the tests compare with the unpadded path.

Buckets: q = 1 for every row size, and q = ``tokens_per_row`` (1 + the drafts a row may
verify) for the row sizes whose tokens stay within ``max_verify_tokens``: each graph keeps
its own logits, [b * q, vocab] floats, so verify buckets stop where that memory would
outgrow what they save.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from streams.batch import ForwardBatch

MAX_VERIFY_TOKENS = 256


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to the first that holds ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1, 2, 4, *range(8, max_batch + 8, 8)]
    return [s for s in sizes if s < max_batch] + [next(s for s in sizes if s >= max_batch)]


class DecodeGraphs:
    def __init__(
        self,
        model: Any,
        kv_cache: Any,
        max_batch: int,
        max_blocks_per_row: int,
        dummy_block: int,
        block_size: int,
        device: torch.device,
        attention: Any = None,  # callable (tables, context_lens, q) -> AttentionPlan
        tokens_per_row: int = 1,  # the verify buckets' q (1: decode buckets only)
        max_verify_tokens: int = MAX_VERIFY_TOKENS,
    ) -> None:
        if tokens_per_row < 1:
            raise ValueError(f"tokens_per_row must be >= 1, got {tokens_per_row}")
        self.model, self.kv_cache = model, kv_cache
        self.sizes = bucket_sizes(max_batch)
        self.keys = [(size, 1) for size in self.sizes]
        if tokens_per_row > 1:
            fits = [s for s in self.sizes if s * tokens_per_row <= max_verify_tokens]
            self.keys += [(size, tokens_per_row) for size in fits]
        self.tokens_per_row = tokens_per_row
        self.dummy_block = dummy_block
        self.dummy_slot = dummy_block * block_size
        self._attention = attention
        most = self.sizes[-1]
        tokens = max(size * q for size, q in self.keys)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.slots = (zeros(tokens) for _ in "ips")
        self.context_lens = zeros(most)
        # Columns past a row's own: a padding token's context may reach past its row's end.
        extra = -(-(tokens_per_row - 1) // block_size)
        self.width = max_blocks_per_row
        self.block_tables = zeros(most, max_blocks_per_row + extra)
        self.block_tables.fill_(dummy_block)
        self.logits_indices = torch.arange(tokens, device=device)
        self.graphs: dict[tuple[int, int], Any] = {}  # bucket -> captured graph
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # bucket -> its graph's logits
        self.pool: Any = None

    def bucket(self, batch: int, longest: int = 1) -> tuple[int, int] | None:
        """The bucket (rows, tokens a row) of a step of ``batch`` rows whose longest runs
        ``longest`` tokens (None: no bucket holds it)."""
        q = 1 if longest == 1 else self.tokens_per_row
        if longest > q:
            return None
        return next(((s, k) for s, k in self.keys if k == q and s >= batch), None)

    def run(
        self,
        input_ids: torch.Tensor,  # [T] int64, placeholders already filled
        positions: torch.Tensor,
        slots: torch.Tensor,
        context_lens: torch.Tensor,  # [B] on the device
        context_host: list[int],  # the same on the host (the eager CPU path plans from them)
        row_tables: torch.Tensor,  # [rows, max_blocks_per_row]: every row's block table
        rows: torch.Tensor,  # [B] int64: the rows of this step, in batch order
        query_lens: np.ndarray | None = None,  # [B] host: tokens of each row (None: one each)
        q_lens: torch.Tensor | None = None,  # the same on the device
        q_starts: torch.Tensor | None = None,  # [B] on the device: each row's first token
    ) -> torch.Tensor:
        """Float32 logits [T, V] of the step's tokens, in order."""
        live, count = rows.shape[0], input_ids.shape[0]
        longest = 1 if query_lens is None else int(query_lens.max())
        key = self.bucket(live, longest)
        if key is None:
            raise ValueError(f"no bucket holds a step of {live} rows of up to {longest} tokens")
        size, q = key
        if q == 1:
            self._pad(live, size, 1)
            self.input_ids[:live].copy_(input_ids)
            self.positions[:live].copy_(positions)
            self.slots[:live].copy_(slots)
            self.context_lens[:live].copy_(context_lens)
            padded_host = context_host
            at = None
        else:
            self._pad(0, size, q)
            # Row i's tokens at i * q onward; its context counts its padding.
            batch_index = torch.repeat_interleave(
                torch.arange(live, device=rows.device), q_lens, output_size=count
            )
            offsets = torch.arange(count, device=rows.device) - q_starts[batch_index]
            at = batch_index * q + offsets
            self.input_ids.index_copy_(0, at, input_ids)
            self.positions.index_copy_(0, at, positions)
            self.slots.index_copy_(0, at, slots)
            self.context_lens[:live].copy_(context_lens + (q - q_lens))
            padded_host = (np.asarray(context_host) + (q - query_lens)).tolist()
        torch.index_select(row_tables, 0, rows, out=self.block_tables[:live, : self.width])
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            logits = self.outputs[key]
        else:
            logits = self._forward(size, q, padded_host + [q] * (size - live))
        return logits[:live] if at is None else logits.index_select(0, at)

    def capture(self, sync: Any, stream: Any) -> None:
        """Capture every bucket, largest first, into one memory pool (a GPU only)."""
        if not sync.graph_capable or self._attention is None:
            raise RuntimeError("decode graphs need CUDA and a device-side attention plan")
        # The KV cache's zeroing and these buffers' were issued on the default stream: the
        # warm-up on ``stream`` must not read them before they are written.
        sync.synchronize()
        for size, q in sorted(self.keys, key=lambda key: key[0] * key[1], reverse=True):
            with sync.use(stream):
                self._pad(0, size, q)
                self._forward(size, q, None)  # warm-up: kernel compiles and allocator
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.outputs[size, q] = self._forward(size, q, None)
            self.pool = graph.pool()
            self.graphs[size, q] = graph

    def _pad(self, first: int, last: int, q: int) -> None:
        """Rows first..last (and their tokens, q each) are padding until live rows overwrite
        theirs: q tokens each of the dummy block."""
        if first >= last:
            return
        self.input_ids[first * q : last * q].zero_()
        self.positions[first * q : last * q].zero_()
        self.slots[first * q : last * q].fill_(self.dummy_slot)
        self.context_lens[first:last].fill_(q)
        self.block_tables[first:last].fill_(self.dummy_block)

    def _forward(self, size: int, q: int, context_host: list[int] | None) -> torch.Tensor:
        tables = self.block_tables[:size]
        attention = None
        if self._attention is not None:
            attention = self._attention(tables, self.context_lens[:size], q)
        tokens = size * q
        batch = ForwardBatch(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            slot_mapping=self.slots[:tokens],
            query_lens=[q] * size,
            context_lens=context_host if context_host is not None else [q] * size,
            block_tables=tables,
            logits_indices=self.logits_indices[:tokens],
            all_sampled=[True] * size,  # buckets run decode and verify steps alone
            attention=attention,
        )
        return self.model(batch, self.kv_cache)
