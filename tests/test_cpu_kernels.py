"""The CPU paged decode-attention kernel: built once, equal to the torch reference, and a
failed build leaves the torch path in charge."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from async_engine.model import cpu_kernels
from async_engine.model.attention_plan import AttentionPlan
from streams.batch import ForwardBatch

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on PATH")


def reference(q, k_cache, v_cache, tables, lens):
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


def random_case(dtype, heads=6, kv_heads=2, dim=32, block=4, lens=(1, 4, 5, 17, 64, 130)):
    gen = torch.Generator().manual_seed(1)
    num_blocks = 120
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    width = -(-max(lens) // block)
    # Scattered, descending block ids: a paging mistake reads someone else's keys.
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@needs_compiler
def test_the_kernel_builds_where_a_compiler_exists():
    assert cpu_kernels.available()
    assert cpu_kernels.library_path().exists()


@needs_compiler
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dim", [64, 128, 32, 24], ids=["d64", "d128", "d32", "odd-width"])
def test_the_kernel_equals_the_torch_reference(dtype, tol, dim):
    q, k, v, tables, lens = random_case(dtype, dim=dim)
    got = cpu_kernels.paged_decode(q, k, v, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), reference(q, k, v, tables, lens), atol=tol, rtol=tol)


@needs_compiler
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [8, 9], ids=["groups-of-8", "groups-of-9"])
def test_the_kernel_handles_one_kv_head_and_large_query_groups(dtype, tol, heads):
    # Groups larger than the fast path's register tile, and one that does not divide it.
    q, k, v, tables, lens = random_case(dtype, heads=heads, kv_heads=1, dim=64, block=16)
    got = cpu_kernels.paged_decode(q, k, v, tables, lens)
    torch.testing.assert_close(got.float(), reference(q, k, v, tables, lens), atol=tol, rtol=tol)


def test_mismatched_shapes_are_refused_by_name():
    if not cpu_kernels.available():
        pytest.skip("no kernel to call")
    q, k, v, tables, lens = random_case(torch.float32)
    with pytest.raises(ValueError, match="block-table rows"):
        cpu_kernels.paged_decode(q, k, v, tables[:2], lens)
    with pytest.raises(ValueError, match="dtype"):
        cpu_kernels.paged_decode(q.bfloat16(), k, v, tables, lens)


def test_a_failed_build_leaves_the_torch_path(monkeypatch, tmp_path: Path, caplog):
    monkeypatch.setenv("ASYNC_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert "using the torch path" in caplog.text
        assert not any(tmp_path.rglob("*.so")), "no torn library is left behind"
        # The attention plan then picks the gather path.
        batch = ForwardBatch(
            input_ids=torch.zeros(2, dtype=torch.long),
            positions=torch.tensor([3, 5]),
            slot_mapping=torch.tensor([3, 9]),
            query_lens=[1, 1],
            context_lens=[4, 6],
            block_tables=torch.tensor([[0, 0], [1, 2]]),
            logits_indices=torch.tensor([0, 1]),
        )
        plan = AttentionPlan.build(batch, 4, False, torch.zeros(8, 4, 1, 8))
        assert plan.decode_lens is None
    finally:
        cpu_kernels.load.cache_clear()


@needs_compiler
def test_a_block_id_outside_the_cache_is_refused_before_the_kernel_reads_it():
    batch = ForwardBatch(
        input_ids=torch.zeros(1, dtype=torch.long),
        positions=torch.tensor([5]),
        slot_mapping=torch.tensor([9]),
        query_lens=[1],
        context_lens=[6],
        block_tables=torch.tensor([[1, 99]]),
        logits_indices=torch.tensor([0]),
    )
    with pytest.raises(ValueError, match="block ids"):
        AttentionPlan.build(batch, 4, False, torch.zeros(8, 4, 1, 8))


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


prefill_kernel = pytest.mark.skipif(
    not cpu_kernels.prefill_supported(torch.bfloat16, 64), reason="needs AVX512-BF16"
)


@prefill_kernel
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (8, 1), (4, 4)])
def test_the_prefill_kernel_equals_causal_attention(dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(2)
    block, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).bfloat16()
    # A fresh prompt, a chunk after a cached prefix, and one long enough for several tasks.
    chunks = [(0, 7), (21, 40), (3, 70)]  # (cached tokens, new tokens)
    q_lens = torch.tensor([n for _, n in chunks])
    ctx = torch.tensor([c + n for c, n in chunks])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    width = -(-int(ctx.max()) // block)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in chunks])
    q = torch.randn(int(q_lens.sum()), heads, dim, generator=gen).bfloat16()
    out = torch.zeros_like(q)
    cpu_kernels.paged_prefill(q, k_cache, v_cache, tables, q_starts, q_lens, ctx, out)
    want = prefill_reference(q, k_cache, v_cache, tables, q_starts, q_lens, ctx)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@prefill_kernel
def test_the_prefill_kernel_leaves_other_rows_alone():
    q = torch.randn(6, 2, 64).bfloat16()
    cache = torch.randn(4, 16, 1, 64).bfloat16()
    out = torch.full_like(q, 7.0)
    one = torch.tensor([3])
    cpu_kernels.paged_prefill(
        q, cache, cache, torch.tensor([[2]]), torch.tensor([2]), one, one, out
    )
    assert (out[:2] == 7).all() and (out[5:] == 7).all() and not (out[2:5] == 7).all()


@needs_compiler
def test_fused_rms_norm_equals_the_float32_formula():
    x = (torch.randn(5, 96) * 3).bfloat16()
    w = torch.randn(96).bfloat16()
    want = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5).float(), want, atol=3e-2, rtol=1e-2)


@needs_compiler
def test_fused_rms_norm_reads_strided_rows():
    wide = torch.randn(4, 40).bfloat16()
    w = torch.ones(16).bfloat16()
    got = cpu_kernels.rms_norm(wide[:, 8:24], w, 1e-6)
    torch.testing.assert_close(got, cpu_kernels.rms_norm(wide[:, 8:24].contiguous(), w, 1e-6))


@needs_compiler
def test_fused_silu_mul_equals_torch_including_large_inputs():
    gate_up = (torch.randn(3, 2 * 50) * 40).bfloat16()  # |x| up to ~150: no overflow
    gate, up = gate_up.float().chunk(2, dim=1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_kernels.silu_mul(gate_up).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-1, rtol=1e-2)


@needs_compiler
def test_fused_rope_equals_the_roll_formula():
    # Token rows strided, as q|k sit inside the fused qkv output.
    x = torch.randn(7, 5, 32).bfloat16().as_strided((7, 3, 32), (5 * 32, 32, 1))
    freqs = torch.arange(7.0)[:, None] * torch.rand(16)
    cos = torch.cat((freqs.cos(), freqs.cos()), -1).bfloat16()
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1).bfloat16()
    want = x.float() * cos[:, None].float() + torch.roll(x.float(), 16, -1) * sin[:, None].float()
    got = cpu_kernels.rope(x, cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


@prefill_kernel
def test_the_default_model_in_bf16_gives_the_same_logits_with_and_without_kernels(
    default_model: Path, monkeypatch
):
    """The kernels' fast paths (head_dim 64) inside the real model: a chunked prefill after a
    cached prefix, a fresh prefill and decodes, against the torch path on the same cache."""
    from async_engine.model import build_model

    model = build_model(str(default_model), "bfloat16")
    gen = torch.Generator().manual_seed(3)
    block = 16
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (70, 45)]
    tables = torch.tensor([[3, 7, 1, 9, 12, 4], [5, 2, 8, 11, 0, 6]])

    def batch(chunks: list[tuple[int, int, int]]) -> ForwardBatch:
        ids, pos, slots = [], [], []
        for seq, start, n in chunks:
            for p in range(start, start + n):
                ids.append(prompts[seq][p])
                pos.append(p)
                slots.append(int(tables[seq, p // block]) * block + p % block)
        lens = [n for _, _, n in chunks]
        return ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(pos),
            slot_mapping=torch.tensor(slots),
            query_lens=lens,
            context_lens=[s + n for _, s, n in chunks],
            block_tables=tables[[seq for seq, _, _ in chunks]],
            logits_indices=torch.cumsum(torch.tensor(lens), 0) - 1,
        )

    steps = [[(0, 0, 40)], [(0, 40, 29), (1, 0, 45)], [(0, 69, 1), (1, 45 - 1, 1)]]
    logits = {}
    for path in ("kernels", "torch"):
        if path == "torch":
            monkeypatch.setattr(cpu_kernels, "available", lambda: False)
            monkeypatch.setattr(cpu_kernels, "elementwise_apply", lambda x: False)
            monkeypatch.setattr(cpu_kernels, "prefill_supported", lambda *a: False)
        kv = model.allocate_kv_cache(16, block)
        with torch.inference_mode():
            logits[path] = [model(batch(chunks), kv) for chunks in steps]
    for got, want in zip(logits["kernels"], logits["torch"], strict=True):
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert cos.min() > 0.995, cos
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5
