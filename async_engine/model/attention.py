"""Attention over a paged KV cache for one packed, variable-length batch.

Each layer writes this step's K/V into the cache, then attends as the step's
``AttentionPlan`` (``attention_plan``) laid out: the Triton kernels, the CPU kernels reading
the cache in place, or torch (batched decode, one SDPA call per prefill), the fallback where
no CPU kernel takes the dtypes and head size (no compiler, or an odd head size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streams.cuda_kernels import try_store_kv

from . import cpu_kernels
from .attention_plan import AttentionPlan


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
    plan: AttentionPlan,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns [T, H * D]."""
    _, _, kv_heads, head_dim = k_cache.shape
    if k.dtype != k_cache.dtype:  # a half-precision cache under a float32 model
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    # On a GPU cuda/kv_cache.cu writes both caches in one launch; elsewhere (or without
    # CuPy) two index copies, which a CUDA graph can capture too.
    if not (
        k_cache.is_cuda
        and try_store_kv(k_cache, v_cache, k.contiguous(), v.contiguous(), slot_mapping)
    ):
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    width = q.shape[1] * head_dim
    if plan.triton is not None:
        return plan.triton.attend(q, k_cache, v_cache).reshape(-1, width)

    decoded = None
    if plan.decode_blocks is not None:
        q_dec = q if plan.decode_rows is None else q[plan.decode_rows]
        decoded = _decode(q_dec, k_cache, v_cache, plan).reshape(-1, width)
        if plan.decode_rows is None:
            return decoded

    result = q.new_empty(plan.num_tokens, width)
    # The CPU kernels write their sequences' rows of result: prompt chunks, then verify rows.
    in_kernels = ((cpu_kernels.paged_prefill, plan.paged_prefill),
                  (cpu_kernels.paged_spans, plan.paged_spans))  # fmt: skip
    for kernel, chunks in in_kernels:
        if chunks is not None:
            kernel(q.contiguous(), k_cache, v_cache, chunks.block_tables, chunks.q_starts,
                   chunks.q_lens, chunks.context_lens, result.view(q.shape))  # fmt: skip
    if decoded is not None:
        result[plan.decode_rows] = decoded
    for p in plan.prefills:
        rows = slice(p.start, p.start + p.query_len)
        if p.blocks is None:
            k_seq, v_seq = k[rows], v[rows]
        else:
            k_seq = _gather(k_cache, p.blocks[None])[0, : p.context_len]
            v_seq = _gather(v_cache, p.blocks[None])[0, : p.context_len]
        # 4-D on purpose: with 3-D inputs and GQA, SDPA falls back to its ~3x slower math path.
        out = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None],
            k_seq.transpose(0, 1)[None].to(q.dtype),
            v_seq.transpose(0, 1)[None].to(q.dtype),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            enable_gqa=True,
        )
        result[rows] = out[0].transpose(0, 1).reshape(p.query_len, width)
    return result


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[B, n] block ids -> [B, n * block_size, KV, D]; whole blocks move as rows (memcpy speed,
    ~8x faster than advanced indexing)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    return rows.view(blocks.shape[0], -1, cache.shape[2], cache.shape[3])


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    """One query per sequence, all sequences at once; returns [B, KV, G, D] (or, from the
    CPU kernel, the same memory as [B, H, D])."""
    if plan.decode_lens is not None:
        return cpu_kernels.paged_decode(q, k_cache, v_cache, plan.decode_blocks, plan.decode_lens)
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    # The G query heads sharing a KV head act as G query rows against it: GQA without
    # repeating K/V, and q keeps its memory layout (head h = kv * G + g).
    q = q.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    k = _gather(k_cache, plan.decode_blocks).transpose(1, 2).to(q.dtype)  # [B, KV, L, D]
    v = _gather(v_cache, plan.decode_blocks).transpose(1, 2).to(q.dtype)
    if not plan.decode_bmm:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask)
    # Two batched matmuls over contiguous per-head K/V: ~1.7x faster than the fused CPU kernel
    # at decode sizes in bf16 (not in float32). Scores are rounded to the model dtype before
    # the float32 softmax, where the fused kernel keeps them in float32.
    span = k.shape[2]
    k = k.reshape(batch * kv_heads, span, head_dim)
    v = v.reshape(batch * kv_heads, span, head_dim)
    scores = torch.bmm(q.reshape(batch * kv_heads, -1, head_dim), k.transpose(1, 2))
    scores = scores.view(batch, kv_heads, -1, span).float() * head_dim**-0.5
    if plan.decode_mask is not None:
        scores = scores + plan.decode_mask
    probs = torch.softmax(scores, -1).to(q.dtype).view(batch * kv_heads, -1, span)
    return torch.bmm(probs, v)
