"""How many KV blocks a GPU holds: what ``gpu_memory_utilization`` leaves after the weights,
a step's activations and other processes."""

from __future__ import annotations

from typing import Any

import torch

from streams.batch import ForwardBatch
from streams.device import DeviceError

# CUDA graphs' pool, the sampler's [B, V] temporaries and the allocator's fragmentation.
RESERVE_BYTES = 768 << 20


def blocks_that_fit(
    total: int, free: int, ours: int, peak: int, share: float, block_bytes: int
) -> int:
    """``total``/``free``: the GPU's memory; ``ours``: what this process holds now (its reserved
    memory); ``peak``: its peak allocation in a full-size step (weights included)."""
    others = total - free - ours  # other processes on the same GPU
    budget = int(total * share) - others - peak - RESERVE_BYTES
    blocks = budget // block_bytes
    if blocks < 2:
        raise DeviceError(
            f"gpu_memory_utilization {share} leaves no room for a KV cache: {total >> 20} MiB "
            f"total, {others >> 20} MiB used by other processes, {peak >> 20} MiB for the "
            f"weights and one step; raise it or use a smaller model"
        )
    return int(blocks)


def kv_blocks_for(model: Any, block_size: int, share: float, step_tokens: int) -> int:
    """Run one prefill of ``step_tokens`` (the largest step the scheduler forms) to measure the
    peak, then size the pool from free memory."""
    device = model.embed.device
    cfg = model.cfg
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    blocks = -(-step_tokens // block_size)
    cache = model.allocate_kv_cache(blocks, block_size)
    cache_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in cache)
    span = torch.arange(step_tokens, device=device)
    batch = ForwardBatch(
        torch.zeros_like(span),
        span,
        span,
        [step_tokens],
        [step_tokens],
        torch.arange(blocks, device=device)[None],
        torch.tensor([step_tokens - 1], device=device),
    )
    with torch.inference_mode():
        model(batch, cache)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - cache_bytes
    del cache, batch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    itemsize = torch.empty(0, dtype=model.dtype).element_size()
    block_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * itemsize
    return blocks_that_fit(
        total, free, torch.cuda.memory_reserved(device), peak, share, block_bytes
    )
