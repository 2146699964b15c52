"""Shared by the CPU kernel tests: the ISA switch, random paged caches and float32 torch
references that gather each sequence's context and attend one sequence at a time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from async_engine.model import cpu_kernels

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on PATH")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}


# Every build on one machine: the native one (AMX and AVX512-BF16 here), the one without AMX
# (what an AVX512-BF16 CPU without AMX runs) and the AVX2 one an AMD EPYC without AVX-512
# runs. Without AMX the second is the first again; without AVX2/FMA/F16C the third cannot run.
ISAS = [
    "native",
    pytest.param(
        "noamx",
        marks=pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="CPU lacks AMX-BF16"),
    ),
    pytest.param(
        "avx2",
        marks=pytest.mark.skipif(
            not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="CPU lacks AVX2+FMA+F16C"
        ),
    ),
]


def switch_isa(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Load the kernels built for ``isa`` from now on (both stay loaded; load() is cleared)."""
    monkeypatch.setenv("ASYNC_ENGINE_CPU_ISA", isa)
    cpu_kernels.load.cache_clear()
    if isa == "avx2" and cpu_kernels.available():
        assert cpu_kernels.isa() == "avx2"


def decode_reference(q, k_cache, v_cache, tables, lens):
    """Gather each sequence's context and attend in float32, one sequence at a time."""
    batch, heads, dim = q.shape
    _, block, kv_heads, _ = k_cache.shape
    out = torch.empty(batch, heads, dim)
    for b in range(batch):
        n = int(lens[b])
        blocks = tables[b, : -(-n // block)]
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:n].float()
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:n].float()
        k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * dim**-0.5
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


def decode_case(dtype, kv_dtype=None, heads=6, kv_heads=2, dim=32, block=4, lens=None):
    """q of ``dtype`` over a cache of ``kv_dtype`` (default: the same), scattered blocks."""
    lens = lens or (1, 4, 5, 17, 64, 130)
    gen = torch.Generator().manual_seed(1)
    num_blocks = 120
    kv_dtype = kv_dtype or dtype
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(kv_dtype)
    width = -(-max(lens) // block)
    # Scattered, descending block ids: a paging mistake reads someone else's keys.
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


def prefill_reference(q, k_cache, v_cache, tables, q_starts, q_lens, ctx_lens):
    """Causal attention per sequence in float32: token j of a chunk sits at ctx - q_len + j."""
    out = torch.zeros(q.shape)
    _, block, kv_heads, dim = k_cache.shape
    for s in range(len(q_lens)):
        start, n, ctx = int(q_starts[s]), int(q_lens[s]), int(ctx_lens[s])
        blocks = tables[s, : -(-ctx // block)]
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:ctx].float().transpose(0, 1)
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:ctx].float().transpose(0, 1)
        qs = q[start : start + n].float().transpose(0, 1)
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        attn = torch.nn.functional.scaled_dot_product_attention(
            qs[None], k[None], v[None], attn_mask=mask, enable_gqa=True
        )
        out[start : start + n] = attn[0].transpose(0, 1)
    return out


def prefill_case(
    dtype, kv_dtype, dim, heads, kv_heads, chunks=((0, 7), (21, 40), (3, 70)), num_blocks=64
):
    """Chunks of (cached tokens, new tokens): a fresh prompt, one after a cached prefix, one
    long enough for several tasks. Returns the kernel's arguments but ``out``."""
    gen = torch.Generator().manual_seed(2)
    block = 16
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(kv_dtype)
    q_lens = torch.tensor([n for _, n in chunks])
    ctx = torch.tensor([c + n for c, n in chunks])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    width = -(-int(ctx.max()) // block)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in chunks])
    q = torch.randn(int(q_lens.sum()), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, q_starts, q_lens, ctx
