"""The forward pass of a pipelined step, issued on the compute stream.

A decode step whose batch fits a bucket runs through the padded decode buffers (a captured
CUDA graph on a GPU); any other step runs the model eagerly, its Triton attention (where the
kernels run) laid out on the device. Either way the step reads its block tables and inputs
from device memory, never from the host.
"""

from __future__ import annotations

from typing import Any

import torch

from streams.batch import ForwardBatch
from streams.pipeline.device_rows import DeviceRows
from streams.pipeline.devsync import DeviceSync
from streams.pipeline.graphs import DecodeGraphs
from streams.rows import StepLayout


class StepForward:
    """The model and its KV cache, with decode buckets once ``use_graphs`` made them."""

    def __init__(self, model: Any, kv_cache: Any, triton: bool) -> None:
        self.model, self.kv_cache, self.triton = model, kv_cache, triton
        self.graphs: DecodeGraphs | None = None

    def use_graphs(
        self,
        sync: DeviceSync,
        compute: Any,
        max_batch: int,
        max_blocks_per_row: int,
        dummy_block: int,
        block_size: int,
        device: torch.device,
        tokens_per_row: int = 1,
    ) -> None:
        """Decode steps of up to ``max_batch`` rows, and verify steps of up to
        ``tokens_per_row`` tokens a row, go through the padded buckets, captured as CUDA
        graphs on ``compute`` where the device can capture."""
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            max_batch,
            max_blocks_per_row,
            dummy_block,
            block_size,
            device,
            self._triton_decode if self.triton else None,
            tokens_per_row,
        )
        if sync.graph_capable:
            if not self.triton:
                return  # the torch attention path plans on the host: nothing to capture
            graphs.capture(sync, compute)
        self.graphs = graphs

    @torch.inference_mode()
    def warm(self, dummy_block: int, block_size: int, device: torch.device) -> None:
        """Compile the Triton attention kernels before the first request: a two-token prompt
        (the varlen kernel) and a decode (the decode kernel), on the padding block nobody
        owns. Their tensors are fresh allocations, aligned as every step's sections are, so
        these are the variants serving launches (tests check it)."""
        if not self.triton:
            return
        for q in (2, 1):
            tables = torch.full((1, 1), dummy_block, dtype=torch.int64, device=device)
            lens = torch.full((1,), q, dtype=torch.int64, device=device)
            starts = torch.zeros(1, dtype=torch.int64, device=device)
            positions = torch.arange(q, dtype=torch.int64, device=device)
            batch = ForwardBatch(
                input_ids=torch.zeros(q, dtype=torch.int64, device=device),
                positions=positions,
                slot_mapping=dummy_block * block_size + positions,
                query_lens=[q],
                context_lens=[q],
                block_tables=tables,
                logits_indices=torch.full((1,), q - 1, dtype=torch.int64, device=device),
                attention=self.model.device_attention(tables, starts, lens, lens, q, q),
            )
            self.model(batch, self.kv_cache)

    def __call__(
        self, layout: StepLayout, dev: dict[str, torch.Tensor], rows: DeviceRows
    ) -> torch.Tensor:
        """The step's logits; ``dev`` holds its packed sections on the device."""
        context_host = layout.context_lens.tolist()
        row_ids = dev["rows"]
        graphs = self.graphs
        if graphs is not None and _every_token_sampled(layout):
            longest = int(layout.query_lens.max())
            if graphs.bucket(len(layout.rows), longest) is not None:
                return graphs.run(
                    dev["input_ids"],
                    dev["positions"],
                    dev["kv_slots"],
                    dev["context_lens"],
                    context_host,
                    rows.tables,
                    row_ids,
                    None if longest == 1 else layout.query_lens,
                    dev["q_lens"],
                    dev["q_starts"],
                )
        tables = rows.tables[:, : max(layout.width, 1)].index_select(0, row_ids)
        attention = None
        if self.triton:
            attention = self.model.device_attention(
                tables,
                dev["q_starts"],
                dev["q_lens"],
                dev["context_lens"],
                int(layout.query_lens.max()),
                layout.num_tokens,
            )
        batch = ForwardBatch(
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            slot_mapping=dev["kv_slots"],
            query_lens=layout.query_lens.tolist(),
            context_lens=context_host,
            block_tables=tables,
            logits_indices=dev["logits_indices"],
            # For the CPU kernels' plan; the Triton one takes every row alike.
            all_sampled=None if self.triton else (layout.query_lens == layout.num_sampled).tolist(),
            attention=attention,
        )
        return self.model(batch, self.kv_cache)

    def _triton_decode(self, tables: torch.Tensor, context_lens: torch.Tensor, q: int) -> Any:
        """A bucket's attention plan: every row runs q tokens (padded to them)."""
        size = tables.shape[0]
        lens = torch.full((size,), q, dtype=torch.int64, device=tables.device)
        starts = torch.arange(0, size * q, q, dtype=torch.int64, device=tables.device)
        return self.model.device_attention(tables, starts, lens, context_lens, q, size * q)


def _every_token_sampled(layout: StepLayout) -> bool:
    """A decode or verify step: each row samples every token it runs (no prompt chunk), so
    its logits are every token's, in order."""
    return len(layout.rows) > 0 and bool((layout.query_lens == layout.num_sampled).all())
