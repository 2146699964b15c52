"""Attention over a paged KV cache for one packed, variable-length batch.

The step's layout (which sequences decode, their gathered block tables, masks) is the same in
every layer, so ``AttentionPlan`` works it out once per forward and each layer only runs
tensor ops: a couple of dozen per layer instead of a Python loop over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streams.batch import ForwardBatch


@dataclass(slots=True)
class Prefill:
    """One sequence with more than one query token; run alone with its own causal mask."""

    start: int  # first row of its tokens in the packed batch
    query_len: int
    context_len: int
    blocks: torch.Tensor | None  # its block ids when a cached prefix must be read, else None
    mask: torch.Tensor | None  # [query_len, context_len] bool, None when is_causal suffices


@dataclass(slots=True)
class AttentionPlan:
    num_tokens: int
    # Decode sequences (query_len == 1) run as one batched call.
    decode_rows: torch.Tensor | None  # their rows in the batch; None when every row decodes
    decode_blocks: torch.Tensor | None  # [Bd, blocks needed by the longest context]
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, L] bool, None when no padding is masked
    prefills: list[Prefill]

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int) -> AttentionPlan:
        q_lens, ctx_lens = batch.query_lens, batch.context_lens
        if len(q_lens) != len(ctx_lens):
            raise ValueError(f"{len(q_lens)} query_lens but {len(ctx_lens)} context_lens")
        device = batch.block_tables.device
        starts, decode, prefills = [], [], []
        start = 0
        for i, (q, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            if q < 1 or ctx < q:
                raise ValueError(f"sequence {i}: query_len {q} with context_len {ctx}")
            starts.append(start)
            if q == 1:
                decode.append(i)
            else:
                prefills.append(_prefill(batch, i, start, q, ctx, block_size, device))
            start += q
        if start != batch.input_ids.shape[0]:
            raise ValueError(f"query_lens sum to {start}, batch has {batch.input_ids.shape[0]}")

        rows = blocks = mask = None
        if decode:
            d_ctx = [ctx_lens[i] for i in decode]
            num_blocks = -(-max(d_ctx) // block_size)
            if len(decode) == len(q_lens):
                blocks = batch.block_tables[:, :num_blocks]
            else:
                rows = torch.tensor([starts[i] for i in decode], device=device)
                blocks = batch.block_tables[torch.tensor(decode, device=device), :num_blocks]
            span = num_blocks * block_size
            if min(d_ctx) < span:
                lens = torch.tensor(d_ctx, device=device)
                mask = torch.arange(span, device=device) < lens[:, None]
                mask = mask.view(len(decode), 1, 1, span)
        return cls(start, rows, blocks, mask, prefills)


def _prefill(
    batch: ForwardBatch, i: int, start: int, q: int, ctx: int, block_size: int, device
) -> Prefill:
    if q == ctx:  # nothing cached before it: its own keys suffice
        return Prefill(start, q, ctx, None, None)
    blocks = batch.block_tables[i, : -(-ctx // block_size)]
    # Query j sits at position ctx - q + j and sees every key up to and including itself.
    q_pos = torch.arange(ctx - q, ctx, device=device)
    mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
    return Prefill(start, q, ctx, blocks, mask)


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
    _, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    num_heads = q.shape[1]
    width = num_heads * head_dim

    decoded = None
    if plan.decode_blocks is not None:
        q_dec = q if plan.decode_rows is None else q[plan.decode_rows]
        batch = q_dec.shape[0]
        # With one query per sequence, the G query heads sharing a KV head can be treated as G
        # query rows against that head: GQA without repeating K/V, and no transposes of q.
        q_dec = q_dec.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
        k_ctx = k_cache[plan.decode_blocks].view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        v_ctx = v_cache[plan.decode_blocks].view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q_dec, k_ctx, v_ctx, attn_mask=plan.decode_mask)
        decoded = out.view(batch, width)
        if plan.decode_rows is None:
            return decoded

    result = q.new_empty(plan.num_tokens, width)
    if decoded is not None:
        result[plan.decode_rows] = decoded
    for p in plan.prefills:
        rows = slice(p.start, p.start + p.query_len)
        q_seq = q[rows].transpose(0, 1)
        if p.blocks is None:
            k_seq, v_seq = k[rows], v[rows]
        else:
            k_seq = k_cache[p.blocks].view(-1, kv_heads, head_dim)[: p.context_len]
            v_seq = v_cache[p.blocks].view(-1, kv_heads, head_dim)[: p.context_len]
        out = F.scaled_dot_product_attention(
            q_seq,
            k_seq.transpose(0, 1),
            v_seq.transpose(0, 1),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            enable_gqa=True,
        )
        result[rows] = out.transpose(0, 1).reshape(p.query_len, width)
    return result
