"""Triton attention over the paged KV cache, as the model calls it: the inputs checked, the
grid sized and the kernels of ``paged_attention_kernels`` launched.

Importing this module imports triton: only the CUDA path (and tests) should.
"""

from __future__ import annotations

import torch
from triton.runtime.jit import JITFunction

from .paged_attention_kernels import LOG2E, MIN_DOT, paged_decode_kernel, paged_varlen_kernel

# Fixed when the decorators ran: TRITON_INTERPRET at import time, not now, decides.
INTERPRETED = not isinstance(paged_decode_kernel, JITFunction)


def varlen_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(block_m, num_warps) for the varlen kernel. Chosen from sm_90a ptxas resource usage
    (cuobjdump, no GPU): half precisions spill nothing; fp32 (a correctness path, FMA dots)
    spills least at 32 x 8 warps. Speed is for the GPU check to tune."""
    if dtype == torch.float32:
        return 32, 8
    return 64, 8 if head_dim > 64 else 4


DECODE_WARPS = 4  # no spills for bf16/fp16 at head_dim 64 and 128


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Shared input checks; returns (group, block_size, head_dim)."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError("q must be [tokens, heads, head_dim], the caches 4-D")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share shape and strides")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q is {q.dtype}, the caches {k_cache.dtype}/{v_cache.dtype}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    _, block_size, kv_heads, head_dim = k_cache.shape
    if q.shape[2] != head_dim or q.shape[1] % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {kv_heads}x{head_dim}")
    if block_size < MIN_DOT or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= {MIN_DOT}, got {block_size}")
    if not q.device == k_cache.device == v_cache.device:
        raise ValueError(f"q is on {q.device}, the caches on {k_cache.device}/{v_cache.device}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("q and the caches must be contiguous in head_dim")
    return q.shape[1] // kv_heads, block_size, head_dim


def _int_vector(x: torch.Tensor, n: int, name: str, device: torch.device) -> None:
    if x.dim() != 1 or x.numel() != n or x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 vector of {n}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, q on {device}")


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [B] int32/int64, each >= 1
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    dot_f32: bool | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context; returns [B, H, D].

    Block ids are not checked (that would sync the device): ``AttentionPlan`` checks them.
    ``dot_f32`` (default: on under the interpreter) runs both dots in float32."""
    group, block_size, head_dim = _check(q, k_cache, v_cache)
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], contiguous rows")
    _int_vector(context_lens, batch, "context_lens", q.device)
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError("out must have q's shape, contiguous in head_dim")
    f32 = INTERPRETED if dot_f32 is None else dot_f32
    grid = (batch, k_cache.shape[2])
    if batch:
        paged_decode_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            block_tables,
            context_lens,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            (scale if scale is not None else head_dim**-0.5) * LOG2E,
            GROUP=group,
            GROUP_PAD=max(MIN_DOT, _pow2(group)),
            HEAD_DIM=head_dim,
            DIM_PAD=_pow2(head_dim),
            BLOCK_SIZE=block_size,
            DOT_F32=f32,
            PRECISION="ieee",
            num_warps=DECODE_WARPS,
        )
    return out


def paged_varlen(
    q: torch.Tensor,  # [T, H, D]: every sequence's query tokens, packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], this step's K already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32/int64
    q_starts: torch.Tensor,  # [S]: row in q of each sequence's first query token
    q_lens: torch.Tensor,  # [S], >= 1
    context_lens: torch.Tensor,  # [S]: tokens in the cache after this step, >= q_lens
    *,
    max_query_len: int | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    dot_f32: bool | None = None,
) -> torch.Tensor:
    """Causal attention of prefills, chunks after a cached prefix and decodes, in one launch;
    returns [T, H, D] (rows no sequence covers are left as they were in ``out``).

    ``max_query_len`` sizes the grid; pass it from the host plan to avoid a device sync."""
    group, block_size, head_dim = _check(q, k_cache, v_cache)
    seqs = q_lens.numel()
    if block_tables.dim() != 2 or block_tables.shape[0] != seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{seqs}, max_blocks], contiguous rows")
    for name, x in (("q_starts", q_starts), ("q_lens", q_lens), ("context_lens", context_lens)):
        _int_vector(x, seqs, name, q.device)
    default_m, num_warps = varlen_config(q.dtype, head_dim)
    block_m = default_m if block_m is None else block_m
    if block_m < MIN_DOT or block_m & (block_m - 1) or block_m < group:
        raise ValueError(f"block_m must be a power of two >= max({MIN_DOT}, {group})")
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError("out must have q's shape, contiguous in head_dim")
    if max_query_len is None:
        max_query_len = int(q_lens.max()) if seqs else 0
    tile_q = block_m // group
    grid = (seqs, -(-max_query_len // tile_q), k_cache.shape[2])
    f32 = INTERPRETED if dot_f32 is None else dot_f32
    if seqs and max_query_len:
        paged_varlen_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            block_tables,
            q_starts,
            q_lens,
            context_lens,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            (scale if scale is not None else head_dim**-0.5) * LOG2E,
            GROUP=group,
            HEAD_DIM=head_dim,
            DIM_PAD=_pow2(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            DOT_F32=f32,
            PRECISION="ieee",
            num_warps=num_warps,
        )
    return out
