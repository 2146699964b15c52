"""The AVX2 int8 matmul (``int8_kernels.matmul_avx2`` / ``linear_avx2``) that ``Int8Linear``
runs on CPUs without int8 dot products: exact int32 sums against torch, the fused layer
bit for bit against the quantize / epilogue path, both builds (AVX2 and native), odd shapes,
and which matmul ``int8_gemm`` picks."""

from __future__ import annotations

import pytest
import torch

from async_engine.model import int8_kernels, quantization
from async_engine.model.quantization import Int8Linear, int8_gemm, quantize_weight

# (rows, k, n): decode sizes of the default model, and odd ones: k odd (a padded pair),
# k = 1, n no multiple of 8 or 16, rows not a multiple of the 6-row tile.
SHAPES = [(1, 576, 960), (37, 577, 131), (6, 1, 8), (7, 1536, 24), (13, 64, 9), (40, 96, 272)]


@pytest.fixture(params=["avx2", "native"])
def isa(request, monkeypatch) -> str:
    """Each test with the library built for AVX2 (-march=haswell) and for this CPU."""
    lib = int8_kernels.load(request.param)
    if lib is None or not hasattr(lib, "int8_matmul_avx2"):
        pytest.skip(f"no {request.param} int8 kernels with AVX2 here")
    monkeypatch.setattr(int8_kernels, "library", lambda: lib)
    return request.param


def operands(rows: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 inputs (zero point 128) and int8 weights, with rows and channels at both ends
    of the range: -127 * -127 pairs are where a u8 x s8 route would saturate."""
    gen = torch.Generator().manual_seed(seed)
    qx = torch.randint(1, 256, (rows, k), dtype=torch.uint8, generator=gen)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    qx[0], q[0] = 1, -127
    if n > 1:
        q[1] = 127
    return qx, q


def test_pack_avx2_layout() -> None:
    q = torch.arange(-60, 60, dtype=torch.int8).view(10, 12)[:9, :11]  # n 9, k 11
    packed = int8_kernels.pack_avx2(q)
    assert packed.shape == (2, 6, 8, 2)  # 2 panels of 8 channels, 6 pairs of inputs
    assert packed[0, 2, 3].tolist() == q[3, 4:6].tolist()  # panel 0, pair 2, channel 3
    assert packed[1, 1, 0].tolist() == q[8, 2:4].tolist()
    assert packed[0, 5, :, 1].abs().sum() == 0 and packed[1, :, 1:].abs().sum() == 0  # padding
    with pytest.raises(ValueError, match="int8"):
        int8_kernels.pack_avx2(q.float())


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_matmul_sums_are_exact(isa: str, rows: int, k: int, n: int) -> None:
    qx, q = operands(rows, k, n)
    got = int8_kernels.matmul_avx2(qx, int8_kernels.pack_avx2(q), n)
    want = (qx.int() - int8_kernels.ZERO_POINT) @ q.int().T
    assert got.dtype == torch.int32 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_linear_equals_quantize_matmul_epilogue_bit_for_bit(
    isa: str, dtype: torch.dtype, rows: int, k: int, n: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    _, q = operands(rows, k, n)
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    index = torch.randperm(k, generator=gen)[: min(5, k - 1)].sort().values
    mask = torch.ones(k)
    mask[index] = 0
    scale, weight = torch.rand(n, generator=gen), torch.randn(len(index), n, generator=gen)
    qx, row_scale = int8_kernels.quantize_rows(x, mask)
    acc = int8_kernels.matmul_avx2(qx, int8_kernels.pack_avx2(q), n).float() * scale
    packed = int8_kernels.pack_avx2(q)
    for bias in (None, torch.randn(n, generator=gen)):
        got = int8_kernels.linear_avx2(x, mask, packed, scale, index, weight, bias)
        want = int8_kernels.epilogue(acc, row_scale, x, index, weight, bias)
        assert got.dtype == dtype and torch.equal(got, want)


def test_bad_operands_are_refused(isa: str) -> None:
    qx, q = operands(4, 32, 16)
    packed = int8_kernels.pack_avx2(q)
    with pytest.raises(ValueError, match="not pack_avx2"):
        int8_kernels.matmul_avx2(qx[:, :30], packed, 16)
    with pytest.raises(ValueError, match="uint8"):
        int8_kernels.matmul_avx2(qx.to(torch.int8), packed, 16)
    x, scale = torch.randn(4, 32), torch.ones(16)
    none, no_weight = torch.zeros(0, dtype=torch.int64), torch.zeros(0, 16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        int8_kernels.linear_avx2(x.half(), torch.ones(32), packed, scale, none, no_weight, None)
    with pytest.raises(ValueError, match="outlier weight"):
        int8_kernels.linear_avx2(x, torch.ones(32), packed, scale, none, torch.zeros(1, 16), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_on_avx2_equals_the_dequantized_reference(
    isa: str, dtype: torch.dtype, monkeypatch
) -> None:
    """As test_quantization's reference test, and the same output as the oneDNN layer's
    epilogue given exact sums."""
    monkeypatch.setenv(quantization.GEMM_ENV, "avx2")
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(48, 64, generator=gen) * 0.1).to(dtype)
    x = (torch.randn(37, 64, generator=gen) * 2).to(dtype)
    x[:, [3, 10]] *= 30
    layer = Int8Linear(weight, x.float().abs().amax(0), outliers=2)
    assert layer.gemm == "avx2" and layer.outlier_index.tolist() == [3, 10]
    bias = torch.randn(48, generator=gen).to(dtype)
    w = weight.float()
    q_w, s_w = quantize_weight(w * layer.keep)
    q_x, s_x = int8_kernels.quantize_rows_torch(x, layer.keep)
    want = ((q_x.float() - int8_kernels.ZERO_POINT) * s_x) @ (q_w.float() * s_w[:, None]).T
    want += x.float()[:, [3, 10]] @ w[:, [3, 10]].T + bias.float()
    got = layer(x.view(1, 37, 64), bias)
    assert got.dtype == dtype and got.shape == (1, 37, 48)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
    torch.testing.assert_close(got[0].float(), want, **tol)


def test_int8_gemm_picks_avx2_where_no_int8_dot_products(isa: str, monkeypatch) -> None:
    monkeypatch.delenv(quantization.GEMM_ENV, raising=False)
    monkeypatch.setenv("ASYNC_ENGINE_CPU_ISA", "avx2")
    assert int8_gemm() == "avx2"
    monkeypatch.setenv("ASYNC_ENGINE_CPU_ISA", "native")
    monkeypatch.setattr(quantization, "_has_int8_dot", lambda: False)  # e.g. AMD Zen 3
    assert int8_gemm() == "avx2"
    monkeypatch.setattr(quantization, "_has_int8_dot", lambda: True)  # VNNI or AMX: oneDNN
    assert int8_gemm() == "onednn"
    monkeypatch.setenv(quantization.GEMM_ENV, "avx2")
    assert int8_gemm() == "avx2"
    monkeypatch.setenv(quantization.GEMM_ENV, "onednn")
    monkeypatch.setenv("ASYNC_ENGINE_CPU_ISA", "avx2")
    assert int8_gemm() == "onednn" and Int8Linear(torch.randn(8, 16)).gemm == "onednn"


def test_int8_gemm_refuses_bad_values(monkeypatch) -> None:
    monkeypatch.setenv(quantization.GEMM_ENV, "vnni")
    with pytest.raises(ValueError, match=r"ASYNC_ENGINE_INT8_GEMM must be auto\|onednn\|avx2"):
        int8_gemm()
    monkeypatch.setenv(quantization.GEMM_ENV, "avx2")
    monkeypatch.setattr(int8_kernels, "library", lambda: None)  # no compiler
    with pytest.raises(ValueError, match="needs the int8 kernels"):
        int8_gemm()
    monkeypatch.setenv(quantization.GEMM_ENV, "auto")
    monkeypatch.setenv("ASYNC_ENGINE_CPU_ISA", "avx2")
    # Auto falls back where the kernel cannot be built, on a CPU where oneDNN is exact (on
    # one without an int8 dot product it refuses: tests/test_quantization.py).
    monkeypatch.setattr(quantization, "_has_int8_dot", lambda: True)
    assert int8_gemm() == "onednn"
