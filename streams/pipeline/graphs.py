"""Decode steps through static buffers in padded buckets: CUDA graphs on a GPU, eager on CPU.

A captured graph replays fixed kernels on fixed addresses, so a decode step of B requests runs
in the smallest bucket b >= B: the live rows are copied into the static buffers and rows B..b
are padding that reads and writes only a reserved dummy block (its KV slot, a context of one
token, a block table of dummy blocks). Their logits are computed and never read. Without
capture (a CPU, ``--cuda-graphs off``) the same buffers run eagerly, which is what the tests
compare with the unpadded path.
"""

from __future__ import annotations

from typing import Any

import torch

from streams.batch import ForwardBatch


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
        attention: Any = None,  # callable (tables, context_lens) -> AttentionPlan, or None
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.sizes = bucket_sizes(max_batch)
        self.dummy_block = dummy_block
        self.dummy_slot = dummy_block * block_size
        self._attention = attention
        most = self.sizes[-1]

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.slots, self.context_lens = (
            zeros(most) for _ in "ipsc"
        )
        self.block_tables = zeros(most, max_blocks_per_row)
        self.logits_indices = torch.arange(most, device=device)
        self._pad(0, most)
        self.graphs: dict[int, Any] = {}  # bucket -> captured graph
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's logits
        self.pool: Any = None

    def bucket(self, batch: int) -> int | None:
        """The bucket a decode step of ``batch`` requests runs in (None: too big)."""
        if batch > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= batch)

    def run(
        self,
        input_ids: torch.Tensor,  # [B] int64, placeholders already filled
        positions: torch.Tensor,
        slots: torch.Tensor,
        context_lens: torch.Tensor,  # [B] on the device
        context_host: list[int],  # the same on the host (the eager CPU path plans from them)
        row_tables: torch.Tensor,  # [rows, max_blocks_per_row]: every row's block table
        rows: torch.Tensor,  # [B] int64: the rows of this step, in batch order
    ) -> torch.Tensor:
        """Float32 logits [B, V] of one decode step."""
        live = input_ids.shape[0]
        size = self.bucket(live)
        if size is None:
            raise ValueError(f"a decode step of {live} exceeds the largest bucket {self.sizes[-1]}")
        self.input_ids[:live].copy_(input_ids)
        self.positions[:live].copy_(positions)
        self.slots[:live].copy_(slots)
        self.context_lens[:live].copy_(context_lens)
        torch.index_select(row_tables, 0, rows, out=self.block_tables[:live])  # no temporary
        self._pad(live, size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            return self.outputs[size][:live]
        return self._forward(size, context_host + [1] * (size - live))[:live]

    def capture(self, sync: Any, stream: Any) -> None:
        """Capture every bucket, largest first, into one memory pool (a GPU only)."""
        if not sync.graph_capable or self._attention is None:
            raise RuntimeError("decode graphs need CUDA and a device-side attention plan")
        self._pad(0, self.sizes[-1])
        for size in reversed(self.sizes):
            with sync.use(stream):
                self._forward(size, None)  # warm-up: kernel compiles and allocator
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.outputs[size] = self._forward(size, None)
            self.pool = graph.pool()
            self.graphs[size] = graph

    def _pad(self, start: int, end: int) -> None:
        if start >= end:
            return
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slots[start:end].fill_(self.dummy_slot)
        self.context_lens[start:end].fill_(1)
        self.block_tables[start:end].fill_(self.dummy_block)

    def _forward(self, size: int, context_host: list[int] | None) -> torch.Tensor:
        tables = self.block_tables[:size]
        attention = None
        if self._attention is not None:
            attention = self._attention(tables, self.context_lens[:size])
        batch = ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slots[:size],
            query_lens=[1] * size,
            context_lens=context_host if context_host is not None else [1] * size,
            block_tables=tables,
            logits_indices=self.logits_indices[:size],
            attention=attention,
        )
        return self.model(batch, self.kv_cache)
