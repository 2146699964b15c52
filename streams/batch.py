"""Tensors of one packed, variable-length forward pass over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, all sequences packed back to back
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset in the KV cache
    query_lens: list[int]  # per sequence; sum == T
    context_lens: list[int]  # per sequence: tokens in the KV cache after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    logits_indices: torch.Tensor  # [S] int64: rows of T whose logits are returned
    # Per sequence, whether it samples each of its query tokens (a decode or verify row, not a
    # prompt chunk); None where unknown. The CPU kernels attend such rows as decode does.
    all_sampled: list[bool] | None = None
    # A prebuilt attention plan (the CUDA runner's, from device tensors): the model then skips
    # planning from the host lists above, which a captured graph could not do.
    attention: Any = None
