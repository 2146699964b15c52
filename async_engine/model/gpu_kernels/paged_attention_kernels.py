"""The Triton kernels of attention over the paged KV cache, in the project's layout.

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

import triton
import triton.language as tl

# Softmax runs in base 2: exp2 is one instruction, so log2(e) is folded into the scale.
LOG2E = 1.4426950408889634
# Smallest M a tensor-core tl.dot accepts (and the smallest K: block sizes must reach it too).
MIN_DOT = 16
# A step's block tables are as wide as its longest row needs, so their stride changes from
# step to step: specialised (1, a multiple of 16, other) it would compile a variant for each
# while serving, for loads of one block id that gain nothing from it. The model's strides are
# fixed for a model and stay specialised (they let the compiler vectorise the q/K/V loads).
VARYING = ["table_stride"]


@triton.jit
def _attend_block(
    q,
    k_at,
    v_at,
    kv_mask,
    score_mask,
    m,
    denom,
    acc,
    qk_scale,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
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


@triton.jit(do_not_specialize=VARYING)
def paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    lens_ptr,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    c_stride_b,
    c_stride_s,
    c_stride_h,
    table_stride,
    qk_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (sequence, KV head): its G query heads against the sequence's blocks."""
    seq = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    slots = tl.arange(0, BLOCK_SIZE)
    heads = kv * GROUP + rows
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
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
        m, denom, acc = _attend_block(
            q,
            k_ptr + offs,
            v_ptr + offs,
            kv_mask,
            key_ok[None, :],
            m,
            denom,
            acc,
            qk_scale,
            DOT_F32,
            PRECISION,
        )
        n += 1
    # A context length of 0 (never planned, but cheap to survive) leaves zeros, not nan.
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(
        out_ptr + seq * o_stride_t + heads[:, None] * o_stride_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


@triton.jit(do_not_specialize=VARYING)
def paged_varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    starts_ptr,
    q_lens_ptr,
    lens_ptr,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    c_stride_b,
    c_stride_s,
    c_stride_h,
    table_stride,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
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
    q = tl.load(
        q_ptr + tok_row[:, None] * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
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
        m, denom, acc = _attend_block(
            q,
            k_ptr + offs,
            v_ptr + offs,
            kv_mask,
            causal,
            m,
            denom,
            acc,
            qk_scale,
            DOT_F32,
            PRECISION,
        )
        n += 1
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(
        out_ptr + tok_row[:, None] * o_stride_t + heads[:, None] * o_stride_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )
