"""The CPU kernels: built once per ISA, decode attention and the fused elementwise ops equal
float32 torch references on every build (native, native without AMX, and the AVX2 one), and a failed build leaves
the torch path in charge. Prefill attention: test_cpu_prefill_kernels.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cpu_kernel_cases import (
    ISAS,
    cpu_flags,
    decode_case,
    decode_reference,
    needs_compiler,
    prefill_case,
    prefill_reference,
    switch_isa,
)

from async_engine.model import cpu_kernels
from async_engine.model.attention_plan import AttentionPlan
from streams.batch import ForwardBatch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# Max abs/rel error against the float32 reference, by output dtype: float32 math throughout,
# so float32 outputs differ by summation order and the exp polynomial (2e-7) only; bf16 and
# fp16 outputs are rounded once (bf16: 8 bits of mantissa, and bf16 products on AVX512-BF16).
TOL = {F32: 1e-5, BF16: 2e-2, F16: 2e-3}
# (q dtype, cache dtype): the model's dtype, and float32 queries over a half-precision cache.
DECODE_TYPES = [(F32, F32), (F32, BF16), (F32, F16), (BF16, BF16), (F16, F16)]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch) -> str:
    switch_isa(monkeypatch, request.param)
    yield request.param
    cpu_kernels.load.cache_clear()  # before monkeypatch restores the ISA


def _ids(types):
    return [f"{str(q)[6:]}-{str(kv)[6:]}" for q, kv in types]


@needs_compiler
def test_each_isa_builds_its_own_library(isa):
    assert cpu_kernels.available()
    path = cpu_kernels.library_path()
    assert path.exists() and f"-{isa}-" in path.name
    built = {
        "native": {"avx512-bf16-amx", "avx512-bf16", "avx512", "avx2"},
        "noamx": {"avx512-bf16"},
        "avx2": {"avx2"},
    }
    assert cpu_kernels.isa() in built[isa]


def test_an_unknown_isa_falls_back_to_native(monkeypatch):
    monkeypatch.setenv("ASYNC_ENGINE_CPU_ISA", "sse9")
    assert cpu_kernels.selected_isa() == "native"


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DECODE_TYPES, ids=_ids(DECODE_TYPES))
@pytest.mark.parametrize("dim", [64, 128, 32, 16, 24], ids=lambda d: f"d{d}")
def test_decode_equals_the_float32_reference(isa, dtype, kv_dtype, dim):
    if not cpu_kernels.decode_supported(dtype, kv_dtype, dim):
        assert kv_dtype != dtype or dtype == F16, "float32 and bf16 decode run everywhere"
        pytest.skip(f"no {dtype} over {kv_dtype} kernel for head_dim {dim} on {isa}")
    q, k, v, tables, lens = decode_case(dtype, kv_dtype, dim=dim)
    got = cpu_kernels.paged_decode(q, k, v, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    tol = TOL[dtype]
    torch.testing.assert_close(
        got.float(), decode_reference(q, k, v, tables, lens), atol=tol, rtol=tol
    )


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DECODE_TYPES, ids=_ids(DECODE_TYPES))
@pytest.mark.parametrize("heads", [8, 9], ids=["groups-of-8", "groups-of-9"])
def test_decode_handles_one_kv_head_and_large_query_groups(isa, dtype, kv_dtype, heads):
    # Groups larger than the register tiles, and ones that do not divide them.
    q, k, v, tables, lens = decode_case(dtype, kv_dtype, heads=heads, kv_heads=1, dim=64, block=16)
    got = cpu_kernels.paged_decode(q, k, v, tables, lens)
    tol = TOL[dtype]
    torch.testing.assert_close(
        got.float(), decode_reference(q, k, v, tables, lens), atol=tol, rtol=tol
    )


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DECODE_TYPES, ids=_ids(DECODE_TYPES))
@pytest.mark.parametrize("kv_heads", [1, 3])
@pytest.mark.parametrize("length", [255, 700, 1900])
def test_decode_of_one_sequence_over_a_long_context_equals_the_reference(
    isa, dtype, kv_dtype, kv_heads, length
):
    """Fewer (sequence, KV head) tasks than threads want: the context is split into parts,
    each attended apart, and merged."""
    if not cpu_kernels.decode_supported(dtype, kv_dtype, 64):
        pytest.skip(f"no {dtype} over {kv_dtype} kernel for head_dim 64 on {isa}")
    q, k, v, tables, lens = decode_case(
        dtype, kv_dtype, heads=3 * kv_heads, kv_heads=kv_heads, dim=64, block=16, lens=(length,)
    )
    got = cpu_kernels.paged_decode(q, k, v, tables, lens)
    tol = TOL[dtype]
    torch.testing.assert_close(
        got.float(), decode_reference(q, k, v, tables, lens), atol=tol, rtol=tol
    )


@needs_compiler
def test_a_rows_decode_does_not_depend_on_the_rows_beside_it(isa):
    """Batch invariance: a lone row (whose context the kernel splits to keep the threads busy)
    gets exactly what it gets beside others."""
    q, k, v, tables, lens = decode_case(F32, heads=6, kv_heads=2, dim=64, block=16,
                                        lens=(1500, 700, 90, 1))  # fmt: skip
    together = cpu_kernels.paged_decode(q, k, v, tables, lens)
    for b in range(len(lens)):
        alone = cpu_kernels.paged_decode(q[b : b + 1], k, v, tables[b : b + 1], lens[b : b + 1])
        assert torch.equal(alone[0], together[b])


# Verify rows (a sequence's last tokens, each sampled) after contexts short and long.
SPANS = ((1495, 5), (0, 16), (40, 17), (700, 2), (3, 1), (250, 9))


def _spans_case(dtype, kv_dtype, heads, kv_heads, chunks=SPANS):
    return prefill_case(dtype, kv_dtype, 64, heads, kv_heads, chunks, num_blocks=100)


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DECODE_TYPES, ids=_ids(DECODE_TYPES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 1), (32, 8)])
def test_spans_equal_causal_attention(isa, dtype, kv_dtype, heads, kv_heads):
    if not cpu_kernels.spans_supported(dtype, kv_dtype, 64):
        pytest.skip(f"no {dtype} spans over {kv_dtype} on {isa}")
    args = _spans_case(dtype, kv_dtype, heads, kv_heads)
    out = torch.zeros_like(args[0])
    cpu_kernels.paged_spans(*args, out)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), prefill_reference(*args), atol=tol, rtol=tol)


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), [(F32, F32), (F32, BF16)], ids=["f32", "f32-bf16"])
def test_each_token_of_a_span_is_attended_exactly_as_decoding_it_alone(isa, dtype, kv_dtype):
    """So a verify step computes, bit for bit, what decoding its tokens one at a time would."""
    if not cpu_kernels.spans_supported(dtype, kv_dtype, 64):
        pytest.skip(f"no {dtype} spans over {kv_dtype} on {isa}")
    q, k, v, tables, q_starts, q_lens, ctx = _spans_case(dtype, kv_dtype, 9, 3)
    out = torch.zeros_like(q)
    cpu_kernels.paged_spans(q, k, v, tables, q_starts, q_lens, ctx, out)
    for s in range(len(q_lens)):
        start, n, end = int(q_starts[s]), int(q_lens[s]), int(ctx[s])
        rows = slice(start, start + n)
        lens = torch.arange(end - n + 1, end + 1)  # each token's context when decoded alone
        alone = cpu_kernels.paged_decode(q[rows], k, v, tables[s].expand(n, -1), lens)
        assert torch.equal(alone, out[rows]), f"span {s}"


@needs_compiler
def test_rows_that_sample_every_token_go_to_the_spans_and_prompt_chunks_to_prefill():
    """A verify row (3 tokens, each sampled), a prompt chunk (3 tokens) and a decode."""
    batch = ForwardBatch(
        input_ids=torch.zeros(7, dtype=torch.long),
        positions=torch.tensor([5, 6, 7, 0, 1, 2, 9]),
        slot_mapping=torch.tensor([5, 6, 7, 16, 17, 18, 41]),
        query_lens=[3, 3, 1],
        context_lens=[8, 3, 10],
        block_tables=torch.tensor([[0], [1], [2]]),
        logits_indices=torch.tensor([0, 1, 2, 5, 6]),
        all_sampled=[True, False, True],
    )
    cache = torch.zeros(4, 16, 2, 64)
    plan = AttentionPlan.build(batch, 16, False, cache, q_dtype=F32)
    assert plan.paged_spans.q_starts.tolist() == [0] and plan.paged_spans.q_lens.tolist() == [3]
    assert plan.paged_prefill.q_starts.tolist() == [3]
    assert plan.decode_lens.tolist() == [10]
    batch.all_sampled = None  # unknown: every chunk of several tokens is a prefill
    assert AttentionPlan.build(batch, 16, False, cache, q_dtype=F32).paged_spans is None


needs_amx = pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="CPU lacks AMX-BF16")
# (heads, KV heads): the default model's groups of 3, one tile of 16, an 8B model's 32/8 in
# two tiles of 16, groups of 1 (no GQA), and 5 groups of 3 that leave a tile's last column.
AMX_HEADS = [(9, 3), (16, 1), (32, 8), (8, 8), (15, 5)]
# Context lengths either side of the 16-row tiles and 32-position value chunks.
AMX_LENS = (1, 2, 15, 16, 17, 31, 32, 33, 47, 64, 130, 300)


@needs_compiler
@needs_amx
@pytest.mark.parametrize(("heads", "kv_heads"), AMX_HEADS, ids=lambda h: str(h))
@pytest.mark.parametrize("dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block", [16, 32], ids=lambda b: f"block{b}")
def test_amx_decode_equals_the_float32_reference(heads, kv_heads, dim, block):
    assert cpu_kernels.decode_kernel(BF16, BF16, heads, kv_heads, dim, block) == "amx"
    q, k, v, tables, lens = decode_case(
        BF16, heads=heads, kv_heads=kv_heads, dim=dim, block=block, lens=AMX_LENS
    )
    got = cpu_kernels.paged_decode(q, k, v, tables, lens)
    torch.testing.assert_close(
        got.float(), decode_reference(q, k, v, tables, lens), atol=TOL[BF16], rtol=TOL[BF16]
    )


@needs_compiler
@needs_amx
def test_amx_decode_never_reads_the_rows_past_a_context():
    # Its tiles load a block's 16 rows whole; the rows past the context hold NaN here.
    q, k, v, tables, lens = decode_case(BF16, heads=9, kv_heads=3, dim=64, block=16, lens=[17])
    last = tables[0, 1]
    k[last, 1:] = float("nan")
    v[last, 1:] = float("nan")
    got = cpu_kernels.paged_decode(q, k, v, tables, lens)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(
        got.float(), decode_reference(q, k, v, tables, lens), atol=TOL[BF16], rtol=TOL[BF16]
    )


@needs_compiler
@needs_amx
def test_amx_decode_leaves_onednn_matmuls_between_its_calls_correct():
    # Both use the tile registers: each configures its own, and neither's state leaks.
    from async_engine.model.llama import linear, pack_weight

    weight = pack_weight(torch.randn(256, 64).to(BF16))
    x = torch.randn(40, 64).to(BF16)
    before = linear(x, weight)
    case = decode_case(BF16, heads=9, kv_heads=3, dim=64, block=16, lens=AMX_LENS)
    first = cpu_kernels.paged_decode(*case)
    assert torch.equal(linear(x, weight), before)
    assert torch.equal(cpu_kernels.paged_decode(*case), first)
    assert torch.equal(linear(x, weight), before)


@needs_compiler
def test_shapes_the_amx_kernel_does_not_take_run_elsewhere(isa):
    # Blocks that split a 16-row tile, groups wider than a tile, other head sizes.
    for heads, kv_heads, dim, block in [(9, 3, 64, 8), (32, 1, 64, 16), (9, 3, 32, 16)]:
        kernel = cpu_kernels.decode_kernel(BF16, BF16, heads, kv_heads, dim, block)
        assert kernel not in (None, "amx")
        case = decode_case(BF16, heads=heads, kv_heads=kv_heads, dim=dim, block=block)
        torch.testing.assert_close(
            cpu_kernels.paged_decode(*case).float(),
            decode_reference(*case),
            atol=TOL[BF16],
            rtol=TOL[BF16],
        )


@needs_compiler
def test_the_build_without_amx_runs_the_avx512_bf16_kernel(monkeypatch):
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("CPU lacks AVX512-BF16")
    switch_isa(monkeypatch, "noamx")
    try:
        assert cpu_kernels.decode_kernel(BF16, BF16, 9, 3, 64, 16) == "avx512-bf16"
    finally:
        cpu_kernels.load.cache_clear()


@needs_compiler
def test_the_avx2_build_runs_every_float32_attention(monkeypatch):
    switch_isa(monkeypatch, "avx2")
    try:
        for q_dtype, kv_dtype in DECODE_TYPES:
            assert cpu_kernels.decode_supported(q_dtype, kv_dtype, 64)
            assert cpu_kernels.prefill_supported(q_dtype, kv_dtype, 64)
        assert not cpu_kernels.prefill_supported(F32, F32, 20)  # not whole vectors
    finally:
        cpu_kernels.load.cache_clear()


def test_mismatched_shapes_are_refused_by_name():
    if not cpu_kernels.available():
        pytest.skip("no kernel to call")
    q, k, v, tables, lens = decode_case(F32)
    with pytest.raises(ValueError, match="block-table rows"):
        cpu_kernels.paged_decode(q, k, v, tables[:2], lens)
    with pytest.raises(ValueError, match="dtype"):
        cpu_kernels.paged_decode(q.bfloat16(), k, v, tables, lens)


def test_a_failed_build_leaves_the_torch_path(monkeypatch, tmp_path: Path, caplog):
    monkeypatch.setenv("ASYNC_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    cpu_kernels.load.cache_clear()
    cpu_kernels.load_isa.cache_clear()
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
        cpu_kernels.load_isa.cache_clear()


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


# --- fused elementwise ops -------------------------------------------------------------------
# (max abs, max rel) error against the float32 formula: float32 differs by summation order
# and exp's polynomial; bf16 is rounded once at the end.
ELEMENTWISE_TOL = {F32: (1e-5, 1e-5), BF16: (3e-2, 1e-2)}
elementwise_dtypes = pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])


@needs_compiler
@elementwise_dtypes
def test_fused_rms_norm_equals_the_float32_formula(isa, dtype):
    x = (torch.randn(5, 96) * 3).to(dtype)
    w = torch.randn(96).to(dtype)
    want = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    atol, rtol = ELEMENTWISE_TOL[dtype]
    got = cpu_kernels.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@needs_compiler
@elementwise_dtypes
def test_fused_rms_norm_reads_strided_rows(isa, dtype):
    wide = torch.randn(4, 40).to(dtype)
    w = torch.ones(16).to(dtype)
    got = cpu_kernels.rms_norm(wide[:, 8:24], w, 1e-6)
    torch.testing.assert_close(got, cpu_kernels.rms_norm(wide[:, 8:24].contiguous(), w, 1e-6))


@needs_compiler
@elementwise_dtypes
def test_fused_silu_mul_equals_torch_including_large_inputs(isa, dtype):
    gate_up = (torch.randn(3, 2 * 50) * 40).to(dtype)  # |x| up to ~150: no overflow
    gate, up = gate_up.float().chunk(2, dim=1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_kernels.silu_mul(gate_up).float()
    assert torch.isfinite(got).all()
    atol, rtol = (1e-4, 1e-5) if dtype == F32 else (1e-1, 1e-2)  # |up| ~ 100: abs scales
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@needs_compiler
@elementwise_dtypes
def test_fused_rope_equals_the_roll_formula(isa, dtype):
    # Token rows strided, as q|k sit inside the fused qkv output.
    x = torch.randn(7, 5, 32).to(dtype).as_strided((7, 3, 32), (5 * 32, 32, 1))
    freqs = torch.arange(7.0)[:, None] * torch.rand(16)
    cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(dtype)
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype)
    want = x.float() * cos[:, None].float() + torch.roll(x.float(), 16, -1) * sin[:, None].float()
    got = cpu_kernels.rope(x, cos, sin)
    assert got.is_contiguous() and got.dtype == dtype
    atol, rtol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@needs_compiler
def test_bench_offline_names_the_cpu_and_the_kernels_isa(isa):
    from async_engine.bench.cpu_info import cpu_info, describe

    info = cpu_info("cpu")
    assert info["isa_setting"] == isa and info["kernel_isa"] == cpu_kernels.isa()
    line = describe(info)
    assert line.startswith("cpu: ") and f"kernels: {cpu_kernels.isa()}" in line
    assert f"ASYNC_ENGINE_CPU_ISA={isa}" in line


def test_the_avx2_switch_makes_auto_choose_float32_as_an_avx2_cpu_does(monkeypatch):
    from async_engine.core.config import EngineConfig

    monkeypatch.setenv("ASYNC_ENGINE_CPU_ISA", "avx2")
    assert EngineConfig(device="cpu").resolved_dtype() == "float32"
