"""Triton attention over the paged KV cache, in the project's layout.

Cache: ``[num_blocks, block_size, KV, D]``; query head ``h`` belongs to KV head ``h // G``.
Each program owns one KV head, so the G query heads sharing it become rows of one ``tl.dot``
and K/V are read once per group, never repeated. Block ids and lengths are read from device
memory, so a launch's grid depends only on batch shape (the decode kernel can be captured in a
CUDA graph).

Loops over KV blocks are ``while`` loops: triton 3.6's interpreter cannot take a ``range``
bound loaded from memory with numpy >= 2.4 (triton-lang/triton#9171). Under the interpreter
bf16/fp16 ``tl.dot`` is wrong (triton-lang/triton#11584), hence ``DOT_F32``: both operands go
to float32 first. ``exp2`` and no libdevice, which the interpreter cannot run.

Importing this module imports triton: only the CUDA path (and tests) should.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# Softmax runs in base 2: exp2 is one instruction, so log2(e) is folded into the scale.
LOG2E = 1.4426950408889634
# Smallest M a tensor-core tl.dot accepts (and the smallest K: block sizes must reach it too).
MIN_DOT = 16


@triton.jit
def _attend_block(q, k_at, v_at, kv_mask, score_mask, m, denom, acc, qk_scale,
                  DOT_F32: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One KV block of online softmax: (running max, denominator, accumulator) updated.

    Masked loads, not just masked scores: stale cache slots may hold inf/nan, and 0 * nan in
    the second dot would poison the row."""
    k = tl.load(k_at, mask=kv_mask, other=0.0)
    v = tl.load(v_at, mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    c_stride_b, c_stride_s, c_stride_h, table_stride,
    qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, KV head): its G query heads against the sequence's blocks."""
    seq = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    slots = tl.arange(0, BLOCK_SIZE)
    heads = kv * GROUP + rows
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
                mask=q_mask, other=0.0)  # fmt: skip
    if DOT_F32:
        q = q.to(tl.float32)
    ctx = tl.load(lens_ptr + seq)
    table = tables_ptr + seq * table_stride
    # Finite start: a padded row never computes (-inf) - (-inf).
    m = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    n = tl.program_id(0) * 0  # an int32 tensor: the loop counter's type must not change
    while n * BLOCK_SIZE < ctx:
        block = tl.load(table + n).to(tl.int64)
        key_ok = n * BLOCK_SIZE + slots < ctx
        offs = block * c_stride_b + slots[:, None] * c_stride_s + kv * c_stride_h + dims[None, :]
        kv_mask = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
        m, denom, acc = _attend_block(q, k_ptr + offs, v_ptr + offs, kv_mask, key_ok[None, :],
                                      m, denom, acc, qk_scale, DOT_F32, PRECISION)  # fmt: skip
        n += 1
    # A context length of 0 (never planned, but cheap to survive) leaves zeros, not nan.
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + seq * o_stride_t + heads[:, None] * o_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)  # fmt: skip


@triton.jit
def paged_varlen_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, q_lens_ptr, lens_ptr,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    c_stride_b, c_stride_s, c_stride_h, table_stride,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, query tile, KV head). A tile holds BLOCK_M // GROUP query
    tokens times their G heads as rows; query t of a sequence sits at position
    ctx - q_len + t (a chunk after a cached prefix), so a decode is a tile of one token."""
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    kv = tl.program_id(2)
    TILE_Q: tl.constexpr = BLOCK_M // GROUP
    q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    if tile * TILE_Q >= q_len:  # the grid covers the longest query; shorter ones end here
        return
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    start = tl.load(starts_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_PAD)
    slots = tl.arange(0, BLOCK_SIZE)
    tok = tile * TILE_Q + rows // GROUP
    heads = kv * GROUP + rows % GROUP
    row_ok = (rows < TILE_Q * GROUP) & (tok < q_len)
    q_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    tok_row = (start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok_row[:, None] * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
                mask=q_mask, other=0.0)  # fmt: skip
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = ctx - q_len + tok
    # Keys past the tile's last query are never seen: the loop stops there, not at ctx.
    end = ctx - q_len + tl.minimum((tile + 1) * TILE_Q, q_len)
    table = tables_ptr + seq * table_stride
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    n = tile * 0
    while n * BLOCK_SIZE < end:
        block = tl.load(table + n).to(tl.int64)
        pos = n * BLOCK_SIZE + slots
        key_ok = pos < end
        offs = block * c_stride_b + slots[:, None] * c_stride_s + kv * c_stride_h + dims[None, :]
        kv_mask = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
        # Every row, padding included, sees key 0 (q_pos >= 0), so no row is all -inf.
        causal = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        m, denom, acc = _attend_block(q, k_ptr + offs, v_ptr + offs, kv_mask, causal,
                                      m, denom, acc, qk_scale, DOT_F32, PRECISION)  # fmt: skip
        n += 1
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + tok_row[:, None] * o_stride_t + heads[:, None] * o_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)  # fmt: skip


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
            q, k_cache, v_cache, out, block_tables, context_lens,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            (scale if scale is not None else head_dim**-0.5) * LOG2E,
            GROUP=group, GROUP_PAD=max(MIN_DOT, _pow2(group)), HEAD_DIM=head_dim,
            DIM_PAD=_pow2(head_dim), BLOCK_SIZE=block_size, DOT_F32=f32, PRECISION="ieee",
            num_warps=DECODE_WARPS,
        )  # fmt: skip
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
            q, k_cache, v_cache, out, block_tables, q_starts, q_lens, context_lens,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            (scale if scale is not None else head_dim**-0.5) * LOG2E,
            GROUP=group, HEAD_DIM=head_dim, DIM_PAD=_pow2(head_dim), BLOCK_SIZE=block_size,
            BLOCK_M=block_m, DOT_F32=f32, PRECISION="ieee", num_warps=num_warps,
        )  # fmt: skip
    return out
