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
    ) -> None:
        """Decode steps of up to ``max_batch`` rows go through the padded buckets, captured as
        CUDA graphs on ``compute`` where the device can capture."""
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            max_batch,
            max_blocks_per_row,
            dummy_block,
            block_size,
            device,
            self._triton_decode if self.triton else None,
        )
        if sync.graph_capable:
            if not self.triton:
                return  # the torch attention path plans on the host: nothing to capture
            graphs.capture(sync, compute)
        self.graphs = graphs

    def __call__(
        self, layout: StepLayout, dev: dict[str, torch.Tensor], rows: DeviceRows
    ) -> torch.Tensor:
        """The step's logits; ``dev`` holds its packed sections on the device."""
        context_host = layout.context_lens.tolist()
        row_ids = dev["rows"]
        decode = bool((layout.query_lens == 1).all() and (layout.num_sampled == 1).all())
        graphs = self.graphs
        if decode and graphs is not None and graphs.bucket(len(layout.rows)) is not None:
            return graphs.run(
                dev["input_ids"],
                dev["positions"],
                dev["kv_slots"],
                dev["context_lens"],
                context_host,
                rows.tables,
                row_ids,
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
            attention=attention,
        )
        return self.model(batch, self.kv_cache)

    def _triton_decode(self, tables: torch.Tensor, context_lens: torch.Tensor) -> Any:
        size = tables.shape[0]
        ones = torch.ones(size, dtype=torch.int64, device=tables.device)
        starts = torch.arange(size, dtype=torch.int64, device=tables.device)
        return self.model.device_attention(tables, starts, ones, context_lens, 1, size)
