"""``--quantization int8``: the kernels against their torch references, the int8 linear layer
against the dequantized-operand reference, tiny models' logits against float32, and the
option's validation from the config and the command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_llama

from async_engine.bench.int8_quality import forced_logits
from async_engine.cli.options import add_engine_args, engine_options
from async_engine.core.config import EngineConfig
from async_engine.model import LlamaModel, build_model, int8_kernels, load_model_config
from async_engine.model import quantization as quant
from async_engine.model.int8_calibration import activation_absmax
from async_engine.model.quantization import (
    QUANTIZED,
    Int8Linear,
    quantize_model,
    quantize_weight,
)

DTYPES = [torch.float32, torch.bfloat16]
# oneDNN's int8 is exact only with an int8 dot product instruction: without one its u8 x s8
# pairs saturate in int16, so the engine never runs it there (the AVX2 kernels do).
ONEDNN_INEXACT = "oneDNN's int8 saturates on a CPU without an int8 dot product instruction"


@pytest.fixture(params=["kernel", "torch"])
def kernels(request, monkeypatch) -> str:
    """Each test twice: with the compiled loops, and with the torch ops a machine without a
    compiler runs (where the CPU has an int8 dot product: without one such a machine is
    refused int8, see the test below)."""
    if request.param == "torch":
        if not quant._has_int8_dot():
            pytest.skip(ONEDNN_INEXACT)
        monkeypatch.setattr(int8_kernels, "library", lambda: None)
    elif int8_kernels.library() is None:
        pytest.skip("no C++ compiler for the int8 kernels")
    return request.param


def test_int8_without_a_dot_product_or_the_avx2_kernels_is_refused_at_start(monkeypatch):
    monkeypatch.setattr(quant, "_has_int8_dot", lambda: False)
    monkeypatch.setattr(int8_kernels, "has_matmul_avx2", lambda: False)
    monkeypatch.delenv(quant.GEMM_ENV, raising=False)
    with pytest.raises(ValueError, match="int8 dot product instruction"):
        quant.check_quantization("int8")


def activations(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of different sizes, two outlier channels, an all-zero row, and exact ties
    (x * 127 / amax = k + 0.5) that round-half-to-even must settle the same way."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[:, [3, 10]] *= 30
    x[1] = 0
    x[2, :3] = torch.tensor([127.0, 0.5, -1.5])  # amax 127: 0.5 and -1.5 are ties
    x[2, 3:] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_matches_torch_bit_for_bit(dtype: torch.dtype) -> None:
    if int8_kernels.library() is None:
        pytest.skip("no C++ compiler for the int8 kernels")
    x = activations(37, 200, dtype)
    mask = torch.ones(200)
    mask[[3, 10]] = 0
    q, scale = int8_kernels.quantize_rows(x, mask)
    want_q, want_scale = int8_kernels.quantize_rows_torch(x, mask)
    assert q.dtype == torch.uint8 and torch.equal(q, want_q) and torch.equal(scale, want_scale)
    signed = q.int() - int8_kernels.ZERO_POINT
    assert signed[2, :3].tolist() == [127, 0, -2]  # ties to even
    assert signed[1].abs().max().item() == 0 and scale[1].item() == 1.0
    assert signed.abs().amax(1)[[0, 3, 4]].tolist() == [127] * 3  # each row spans the range
    assert signed[:, [3, 10]].abs().max().item() == 0  # masked columns


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outliers", [0, 5])
def test_epilogue_matches_torch(dtype: torch.dtype, outliers: int) -> None:
    gen = torch.Generator().manual_seed(1)
    rows, cols, n = 9, 70, 131  # n: two blocks of 64 columns and a tail
    acc, x = torch.randn(rows, n, generator=gen), torch.randn(rows, cols, generator=gen)
    row_scale, bias = torch.rand(rows, 1, generator=gen), torch.randn(n, generator=gen)
    index = torch.randperm(cols, generator=gen)[:outliers].sort().values
    weight = torch.randn(outliers, n, generator=gen)
    for b in (None, bias):
        got = int8_kernels.epilogue(acc, row_scale, x.to(dtype), index, weight, b)
        want = int8_kernels.epilogue_torch(acc, row_scale, x.to(dtype), index, weight, b)
        assert got.dtype == dtype
        # float32: FMA order only; bfloat16: at most one rounding step apart.
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_quantize_weight_is_symmetric_per_output_channel() -> None:
    w = torch.randn(6, 50)
    w[4] = 0
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (6,)
    assert q.abs().amax(1).tolist() == [127] * 4 + [0, 127]
    assert scale[4].item() == 1.0
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()  # within half a step


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_equals_the_dequantized_reference(dtype: torch.dtype, kernels: str) -> None:
    """y = dequant(int8 x) @ dequant(int8 W).T + x[:, outliers] @ W[:, outliers].T + bias,
    to float32 rounding (bfloat16: its own rounding of y), and close to the float matmul."""
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(48, 64, generator=gen) * 0.1).to(dtype)
    x = activations(11, 64, dtype, seed=3)
    absmax = x.float().abs().amax(0)
    bias = torch.randn(48, generator=gen).to(dtype)
    layer = Int8Linear(weight, absmax, outliers=2)
    assert layer.outlier_index.tolist() == [3, 10]
    w = weight.float()
    q_w, s_w = quantize_weight(w * layer.keep)
    q_x, s_x = int8_kernels.quantize_rows_torch(x, layer.keep)
    want = ((q_x.float() - int8_kernels.ZERO_POINT) * s_x) @ (q_w.float() * s_w[:, None]).T
    want += x.float()[:, [3, 10]] @ w[:, [3, 10]].T + bias.float()
    got = layer(x, bias)
    assert got.dtype == dtype and got.shape == (11, 48)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
    torch.testing.assert_close(got.float(), want, **tol)
    exact = x.float() @ w.T + bias.float()
    cos = torch.nn.functional.cosine_similarity(got.float(), exact, dim=-1)
    assert cos[[0, *range(2, 11)]].min() > 0.999  # row 1 is all zero: y = bias there


def test_int8_linear_takes_3d_inputs_and_refuses_float16() -> None:
    layer = Int8Linear(torch.randn(8, 16))
    x = torch.randn(2, 3, 16)
    assert layer(x).shape == (2, 3, 8)
    torch.testing.assert_close(layer(x)[1], layer(x[1]))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layer(x.half())


TINY = {
    "llama": {"architecture": "LlamaForCausalLM"},
    "qwen2-bias": {"architecture": "Qwen2ForCausalLM"},  # q/k/v biases through the epilogue
}


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request, tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp(request.param), **TINY[request.param])


@pytest.mark.parametrize("gemm", ["onednn", "avx2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_int8_logits_stay_close_to_float32(
    tiny: Path, dtype: str, gemm: str, monkeypatch
) -> None:
    if gemm == "avx2" and not int8_kernels.has_matmul_avx2():
        pytest.skip("no int8 kernels for AVX2 here")
    if gemm == "onednn" and not quant._has_int8_dot():
        pytest.skip(ONEDNN_INEXACT)
    monkeypatch.setenv("ASYNC_ENGINE_INT8_GEMM", gemm)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 23, 40)]
    outputs = [torch.randint(0, 128, (8,), generator=gen).tolist() for _ in prompts]
    want = forced_logits(build_model(str(tiny), "float32"), prompts, outputs)
    model = build_model(str(tiny), dtype, quantization="int8")
    assert isinstance(model.layers[0].gate_up, Int8Linear) and model.layers[0].gate_up.gemm == gemm
    got = forced_logits(model, prompts, outputs)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert got.dtype == torch.float32 and cos.mean() > 0.99 and cos.min() > 0.95


def test_calibration_puts_the_weights_back(tiny: Path) -> None:
    model = LlamaModel(load_model_config(tiny))
    model.load_weights(tiny)
    before = {n: p.clone() for n, p in model.named_parameters()}
    absmax = activation_absmax(model, QUANTIZED)
    assert set(absmax) == {(i, n) for i in range(len(model.layers)) for n in QUANTIZED}
    for (i, name), seen in absmax.items():
        assert seen.shape == (getattr(model.layers[i], name).shape[1],) and (seen > 0).all()
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_quantize_after_packing_is_refused(tiny: Path) -> None:
    model = build_model(str(tiny), "float32")
    with pytest.raises(RuntimeError, match="before pack_weights"):
        quantize_model(model)


def test_bad_quantization_values_are_refused_by_name(tiny: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization must be none\|int8, got 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization int8 runs on the CPU device only"):
        EngineConfig(quantization="int8", device="cuda")
    with pytest.raises(ValueError, match=r"quantization must be none\|int8, got 'fp8'"):
        build_model(str(tiny), "float32", quantization="fp8")
    assert EngineConfig(quantization="int8").quantization == "int8"


def test_the_command_line_takes_the_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_options(parser.parse_args([]))["quantization"] == "none"
    options = engine_options(parser.parse_args(["--quantization", "int8"]))
    assert EngineConfig(**options).quantization == "int8"
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        parser.parse_args(["--quantization", "int4"])


def test_the_engine_generates_with_int8(tmp_path: Path) -> None:
    from async_engine.core.llm import LLM
    from sampler.params import SamplingParams

    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "eos_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    options = {"load_format": "dummy", "device": "cpu", "device_threads": 1}
    outs = {}
    for quantization in ("none", "int8"):
        with LLM(model=str(tmp_path), dtype="float32", quantization=quantization, **options) as llm:
            outs[quantization] = [o.token_ids for o in llm.generate([[3, 4, 5], [7, 8]], params)]
    assert [len(t) for t in outs["int8"]] == [4, 4]
    assert all(0 <= t < 96 for toks in outs["int8"] for t in toks)
