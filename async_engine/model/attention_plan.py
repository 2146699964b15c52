"""The layout of one step's attention, worked out once per forward.

The layout (which sequences decode together, their block tables and masks, which path runs
each sequence) is the same in every layer, so ``AttentionPlan.build`` works it out once and
each layer only runs tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streams.batch import ForwardBatch

from . import cpu_kernels, gpu_kernels


@dataclass(slots=True)
class Prefill:
    """One sequence with more than one query token; run alone with its own causal mask."""

    start: int  # first row of its tokens in the packed batch
    query_len: int
    context_len: int
    blocks: torch.Tensor | None  # its block ids when a cached prefix must be read, else None
    mask: torch.Tensor | None  # [query_len, context_len] bool, None when is_causal suffices


@dataclass(slots=True)
class PagedPrefill:
    """Every prefill sequence of the step, for the CPU kernel that reads the cache in place."""

    block_tables: torch.Tensor  # [S, blocks the longest context needs] int64
    q_starts: torch.Tensor  # [S] int64: each sequence's first row in the batch
    q_lens: torch.Tensor  # [S] int64
    context_lens: torch.Tensor  # [S] int64


@dataclass(slots=True)
class TritonAttention:
    """The whole step for the Triton kernels: one launch per layer, whatever the mix."""

    block_tables: torch.Tensor  # [S, blocks the longest context needs], on the cache's device
    q_starts: torch.Tensor  # [S]
    q_lens: torch.Tensor  # [S]
    context_lens: torch.Tensor  # [S]
    max_query_len: int  # sizes the grid from the host: no device sync per layer

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        from .gpu_kernels import paged_attention as kernels

        if self.max_query_len == 1:  # every row decodes: the graph-friendly kernel
            return kernels.paged_decode(q, k_cache, v_cache, self.block_tables, self.context_lens)
        return kernels.paged_varlen(
            q,
            k_cache,
            v_cache,
            self.block_tables,
            self.q_starts,
            self.q_lens,
            self.context_lens,
            max_query_len=self.max_query_len,
        )


@dataclass(slots=True)
class AttentionPlan:
    num_tokens: int
    # Decode sequences (query_len == 1) run as one batched call.
    decode_rows: torch.Tensor | None  # their rows in the batch; None when every row decodes
    decode_blocks: torch.Tensor | None  # [Bd, blocks the longest context needs]; None: no decode
    # Masks the padding past each context: a bool [Bd, 1, 1, L] for SDPA, an additive float
    # bias of that shape for the bmm path; None when nothing needs masking.
    decode_mask: torch.Tensor | None
    decode_bmm: bool  # bmm path instead of SDPA (see _decode)
    prefills: list[Prefill]
    # The CPU kernel reads the paged cache in place; then decode_mask is unused and these are
    # the decode sequences' context lengths (int64 [Bd]).
    decode_lens: torch.Tensor | None = None
    paged_prefill: PagedPrefill | None = None  # set: prefills run in the CPU kernel, in one call
    # Verify rows (several tokens, each sampled) for the CPU decode kernel (cpu_kernels.paged_spans).
    paged_spans: PagedPrefill | None = None
    triton: TritonAttention | None = None  # set: every row runs in the Triton kernels (CUDA)

    @classmethod
    def for_triton(cls, attention: TritonAttention, num_tokens: int) -> AttentionPlan:
        """A plan whose layout the caller built on the device (the CUDA runner, a graph)."""
        return cls(num_tokens, None, None, None, False, [], triton=attention)

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        block_size: int,
        decode_bmm: bool,
        cache: torch.Tensor | None = None,
        triton: bool | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> AttentionPlan:
        """``cache`` (a layer's K cache: its size, dtype and device) lets the CPU kernels read
        the paged cache in place where they take its dtype and ``q_dtype`` (the model's,
        default the cache's). ``triton`` runs the step in the Triton
        kernels; None picks them for a CUDA cache where they load (tests force them on CPU
        tensors under Triton's interpreter)."""
        q_lens, ctx_lens = batch.query_lens, batch.context_lens
        if not len(q_lens) == len(ctx_lens) == batch.block_tables.shape[0]:
            raise ValueError(
                f"{len(q_lens)} query_lens, {len(ctx_lens)} context_lens and "
                f"{batch.block_tables.shape[0]} block_tables rows: one each per sequence"
            )
        if triton is None:
            triton = cache is not None and cache.is_cuda and gpu_kernels.available()
        device = batch.block_tables.device
        kernel_cache = cache if cache is not None and _kernels_apply(cache, q_dtype) else None
        in_kernel = kernel_cache is not None and cpu_kernels.prefill_supported(
            q_dtype or kernel_cache.dtype, kernel_cache.dtype, kernel_cache.shape[-1]
        )
        sampled = batch.all_sampled
        if kernel_cache is None or sampled is None or not _spans_as_decode(kernel_cache, q_dtype):
            sampled = [False] * len(q_lens)
        starts, decode, prefills, in_kernel_rows, spans = [], [], [], [], []
        start = 0
        for i, (q, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            if q < 1 or ctx < q:
                raise ValueError(f"sequence {i}: query_len {q} with context_len {ctx}")
            starts.append(start)
            if triton:  # one launch takes every row: no per-sequence masks to build
                pass
            elif q == 1:
                decode.append(i)
            elif sampled[i]:
                spans.append(i)
            elif in_kernel:
                in_kernel_rows.append(i)
            else:
                prefills.append(_prefill(batch, i, start, q, ctx, block_size))
            start += q
        if start != batch.input_ids.shape[0]:
            raise ValueError(f"query_lens sum to {start}, batch has {batch.input_ids.shape[0]}")
        if triton:
            return cls(
                start,
                None,
                None,
                None,
                decode_bmm,
                [],
                triton=_triton_plan(batch, starts, block_size, cache),
            )
        paged = paged_spans = None
        if in_kernel_rows:
            paged = _paged_prefill(batch, in_kernel_rows, starts, block_size, kernel_cache)
        if spans:
            paged_spans = _paged_prefill(batch, spans, starts, block_size, kernel_cache)

        rows = blocks = mask = kernel_lens = None
        if decode:
            d_ctx = [ctx_lens[i] for i in decode]
            num_blocks = -(-max(d_ctx) // block_size)
            if num_blocks > batch.block_tables.shape[1]:
                raise ValueError(f"context {max(d_ctx)} needs more blocks than block_tables has")
            if len(decode) == len(q_lens):
                blocks = batch.block_tables[:, :num_blocks]
            else:
                rows = torch.tensor([starts[i] for i in decode], device=device)
                blocks = batch.block_tables[torch.tensor(decode, device=device), :num_blocks]
            span = num_blocks * block_size
            if kernel_cache is not None:
                _check_block_ids(blocks, kernel_cache.shape[0])
                blocks = blocks.contiguous()  # once here, not in every layer
                kernel_lens = torch.tensor(d_ctx, dtype=torch.int64)
            elif min(d_ctx) < span:
                lens = torch.tensor(d_ctx, device=device)
                valid = (torch.arange(span, device=device) < lens[:, None]).view(-1, 1, 1, span)
                if decode_bmm:
                    mask = torch.zeros(valid.shape, device=device).masked_fill_(~valid, -torch.inf)
                else:
                    mask = valid
        return cls(start, rows, blocks, mask, decode_bmm, prefills, kernel_lens, paged, paged_spans)


def _triton_plan(
    batch: ForwardBatch, starts: list[int], block_size: int, cache: torch.Tensor | None
) -> TritonAttention:
    width = -(-max(batch.context_lens) // block_size)
    if width > batch.block_tables.shape[1]:
        raise ValueError(
            f"context {max(batch.context_lens)} needs more blocks than block_tables has"
        )
    tables = batch.block_tables[:, :width].contiguous()
    if cache is not None and not tables.is_cuda:
        # The kernels trust their block ids. On a GPU reading them back would stall the step;
        # there they come from the engine's own allocator.
        _check_block_ids(tables, cache.shape[0])
    device = tables.device

    def int32s(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return TritonAttention(
        tables,
        int32s(starts),
        int32s(batch.query_lens),
        int32s(batch.context_lens),
        max(batch.query_lens),
    )


def _kernels_apply(cache: torch.Tensor, q_dtype: torch.dtype | None) -> bool:
    """Whether the CPU decode kernel reads this cache in place for queries of ``q_dtype``."""
    return cache.device.type == "cpu" and cpu_kernels.decode_supported(
        q_dtype or cache.dtype, cache.dtype, cache.shape[-1]
    )


def _spans_as_decode(cache: torch.Tensor, q_dtype: torch.dtype | None) -> bool:
    """Whether verify rows go to the CPU decode kernel's spans: where decoding runs that
    (vector) kernel too, so each of a row's tokens is attended exactly as decoding it alone
    (bf16 over bf16 on AVX512-BF16 and AMX decodes in other kernels: their prefill takes them)."""
    q_dtype = q_dtype or cache.dtype
    _, block_size, kv_heads, head_dim = cache.shape
    kernel = cpu_kernels.decode_kernel(
        q_dtype, cache.dtype, kv_heads, kv_heads, head_dim, block_size
    )
    return kernel == "vector" and cpu_kernels.spans_supported(q_dtype, cache.dtype, head_dim)


def _check_block_ids(blocks: torch.Tensor, cache_blocks: int) -> None:
    """The kernels trust their block ids, so they are checked here, once per step."""
    if blocks.numel() and not 0 <= int(blocks.min()) <= int(blocks.max()) < cache_blocks:
        raise ValueError(f"block ids must lie in [0, {cache_blocks})")


def _paged_prefill(
    batch: ForwardBatch, seqs: list[int], starts: list[int], block_size: int, cache: torch.Tensor
) -> PagedPrefill:
    ctx = [batch.context_lens[i] for i in seqs]
    width = -(-max(ctx) // block_size)
    if width > batch.block_tables.shape[1]:
        raise ValueError(f"context {max(ctx)} needs more blocks than block_tables has")
    index = torch.tensor(seqs)
    tables = batch.block_tables[index, :width].to(torch.int64).contiguous()
    _check_block_ids(tables, cache.shape[0])

    def int64s(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    q_lens = [batch.query_lens[i] for i in seqs]
    return PagedPrefill(tables, int64s([starts[i] for i in seqs]), int64s(q_lens), int64s(ctx))


def _prefill(batch: ForwardBatch, i: int, start: int, q: int, ctx: int, block_size: int) -> Prefill:
    if q == ctx:  # nothing cached before it: its own keys suffice
        return Prefill(start, q, ctx, None, None)
    num_blocks = -(-ctx // block_size)
    if num_blocks > batch.block_tables.shape[1]:
        raise ValueError(f"sequence {i}: context {ctx} needs more blocks than block_tables has")
    device = batch.block_tables.device
    # Query j sits at position ctx - q + j and sees every key up to and including itself.
    q_pos = torch.arange(ctx - q, ctx, device=device)
    mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
    return Prefill(start, q, ctx, batch.block_tables[i, :num_blocks], mask)
