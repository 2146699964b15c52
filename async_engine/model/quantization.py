"""int8 linear layers (``--quantization int8``): int8 weights with per-output-channel scales.

Weights are quantized at load time from the float checkpoint, symmetric per output channel
(``scale = max|w_row| / 127``), and kept in oneDNN's packed int8 layout: a quarter of
float32's bytes, half of bfloat16's. Each call quantizes its input rows too (one scale per
token, found on the fly: ``int8_kernels.py``) and runs oneDNN's int8 matmul, which uses the
CPU's int8 dot products (AMX-INT8, AVX512-VNNI or AVX-VNNI, else AVX2's ``vpmaddubsw``);
the epilogue scales the int32 sums back into the activations' dtype (float32 or bfloat16).
On CPUs without int8 dot products (AVX2 only: AMD Zen 1-3) oneDNN's int8 is no faster than
its float32, and ``int8_kernels.linear_avx2`` runs instead (``int8_gemm``).
This is the int8 W8A8 scheme vLLM runs on CPUs (dynamic per-token activations), not
weight-only: torch's weight-only kernel (``aten._weight_int8pack_mm``) reads the weights
again for every row, so it beats bfloat16 at one row only and is 3x slower at 32 (measured).
A few outlier channels per matmul stay in float (``Int8Linear``); ``bench/int8_quality.py``
checks the result against float32.

The attention and MLP projections are quantized; the embedding and the head stay in the
model dtype: the head in int8 was measured at 95.1% greedy agreement with float32, too close
to the 95% floor, and the embedding is a lookup.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch import nn

from . import int8_kernels
from .int8_kernels import ZERO_POINT, epilogue, quantize_rows

QUANTIZATIONS = ("none", "int8")
QUANTIZED = ("qkv", "o_proj", "gate_up", "down")  # DecoderLayer's matmul weights
PACK_ROWS_HINT = 32  # rows oneDNN tunes the packed layout for: a decode batch
# Input channels per matmul kept out of int8 (see Int8Linear). 16 of the default model's 576
# take its greedy agreement with float32 from 90% to 96% (bench/int8_quality.py); o_proj's
# inputs (attention outputs) have none that matter.
OUTLIERS = {"qkv": 16, "o_proj": 0, "gate_up": 16, "down": 16}
# Which int8 matmul runs: "onednn", "avx2" (int8_kernels.linear_avx2) or "auto" (the default):
# avx2 where the CPU has no int8 dot product instruction (AVX512-VNNI, AVX-VNNI or AMX-INT8)
# or ASYNC_ENGINE_CPU_ISA=avx2 says to run as such a CPU does. There oneDNN's int8 was slower
# than its float32 and not exact (its u8 x s8 pairs saturate in int16); the AVX2 kernel took
# a 40-row decode step's matmuls from 85 to 51 ms (2 cores). With those instructions oneDNN
# is exact and much faster.
GEMM_ENV = "ASYNC_ENGINE_INT8_GEMM"
GEMMS = ("auto", "onednn", "avx2")
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def check_quantization(quantization: str, device: str = "cpu") -> None:
    """Raise ValueError naming the field for an unknown value or a device it cannot run on."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be {'|'.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "int8" and device != "cpu":
        raise ValueError(f"quantization int8 runs on the CPU device only, not {device!r}")
    if quantization == "int8" and not torch.backends.mkldnn.is_available():
        raise ValueError("quantization int8 needs torch with oneDNN (an x86 CPU build)")
    if quantization == "int8":
        int8_gemm()  # a CPU it cannot run exactly on is refused here, at start


@functools.cache
def _has_int8_dot() -> bool:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return True  # unknown CPU: keep oneDNN, which picks its own kernels
    flags = {f for ln in lines if ln.startswith("flags") for f in ln.split(":", 1)[1].split()}
    return any(f in flags for f in INT8_DOT_FLAGS)


def int8_gemm() -> str:
    """The int8 matmul ``Int8Linear`` uses, "onednn" or "avx2", as ``GEMM_ENV`` asks."""
    value = os.environ.get(GEMM_ENV) or "auto"
    if value not in GEMMS:
        raise ValueError(f"{GEMM_ENV} must be {'|'.join(GEMMS)}, got {value!r}")
    if value == "avx2" and not int8_kernels.has_matmul_avx2():
        raise ValueError(f"{GEMM_ENV}=avx2 needs the int8 kernels built for a CPU with AVX2")
    if value != "auto":
        return value
    if not _has_int8_dot() and not int8_kernels.has_matmul_avx2():
        raise ValueError(
            "quantization int8 on a CPU without an int8 dot product instruction (AVX512-VNNI, "
            "AVX-VNNI or AMX-INT8) needs the AVX2 int8 kernels, built at start with a C++ "
            "compiler (none could be built here): oneDNN's int8 saturates on such a CPU"
        )
    avx2_cpu = os.environ.get("ASYNC_ENGINE_CPU_ISA") == "avx2" or not _has_int8_dot()
    return "avx2" if avx2_cpu and int8_kernels.has_matmul_avx2() else "onednn"


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 [out, in], float32 scales [out]).

    An all-zero row gets scale 1 so dequantizing never divides by zero.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def outlier_channels(act_absmax: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` input channels with the largest calibration magnitudes, ascending."""
    count = min(count, act_absmax.numel())
    return act_absmax.float().topk(count).indices.sort().values


class Int8Linear(nn.Module):
    """``y = x @ W.T`` with int8 weights and per-token int8 activations, but for a few
    outlier input channels that stay in float (LLM.int8()'s decomposition).

    A handful of channels carry values tens of times larger than the rest in some tokens
    (the first token's above all); in a per-token int8 row they would flatten every other
    channel of that token to a few levels, and with it the keys and values every later token
    reads. Those channels (``outlier_channels`` of the calibration ranges ``act_absmax``)
    are zeroed in the int8 operands and added back by a small float matmul.

    ``llama.linear`` calls it in place of a weight tensor. Only the matmul's packed copy of
    the int8 weight is kept (``gemm``: oneDNN's, which cannot be read back, or
    ``int8_kernels.pack_avx2``'s): ``quantize_weight(weight * keep)`` gives the values and
    scales it holds.
    """

    def __init__(
        self, weight: torch.Tensor, act_absmax: torch.Tensor | None = None, outliers: int = 0
    ) -> None:
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        index = torch.zeros(0, dtype=torch.int64)
        if act_absmax is not None and outliers > 0:
            index = outlier_channels(act_absmax, outliers)
        keep = torch.ones(self.in_features)
        keep[index] = 0.0
        q, scale = quantize_weight(w * keep)
        self.register_buffer("keep", keep, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        self.register_buffer("zero_points", zero_points, persistent=False)
        self.gemm = int8_gemm()
        if self.gemm == "avx2":
            self.packed = int8_kernels.pack_avx2(q)
        else:
            self.packed = torch.ops.onednn.qlinear_prepack(q, [PACK_ROWS_HINT, self.in_features])
        self.register_buffer("outlier_index", index, persistent=False)
        # [outliers, out] float32: the epilogue adds x[:, index] @ outlier_weight.
        outlier_weight = w[:, index].t().contiguous()
        self.register_buffer("outlier_weight", outlier_weight, persistent=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"int8 linear takes float32 or bfloat16 inputs, got {x.dtype}")
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if self.gemm == "avx2":  # quantize, matmul and epilogue in one call
            weights = (self.packed, self.scale, self.outlier_index, self.outlier_weight)
            y = int8_kernels.linear_avx2(x, self.keep, *weights, bias)
            return y.view(*shape[:-1], self.out_features)
        qx, row_scale = quantize_rows(x, self.keep)
        # oneDNN takes one activation scale per tensor, not per row: the sums come back in
        # float32 at scale 1, and the epilogue scales the rows.
        weight = (self.packed, self.scale, self.zero_points)
        # No bias; output scale 1, zero point 0, float32; no post-op.
        output = (None, 1.0, 0, torch.float32, "none", [], "")
        acc = torch.ops.onednn.qlinear_pointwise(qx, 1.0, ZERO_POINT, *weight, *output)
        y = epilogue(acc, row_scale, x, self.outlier_index, self.outlier_weight, bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        outliers = self.outlier_index.numel()
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8, "
            f"{outliers=}, gemm={self.gemm}"
        )


@torch.no_grad()
def quantize_model(model: nn.Module, outliers: dict[str, int] | None = None) -> None:
    """Replace every decoder layer's matmul weights by ``Int8Linear``, with ``outliers``
    (default ``OUTLIERS``) float channels per weight name, found by one calibration forward
    (``int8_calibration.py``). Call after loading the float weights and before
    ``pack_weights`` (which leaves these modules be)."""
    from .int8_calibration import activation_absmax

    outliers = OUTLIERS if outliers is None else outliers
    for layer in model.layers:
        for name in QUANTIZED:
            weight = getattr(layer, name)
            if isinstance(weight, torch.Tensor) and weight.is_mkldnn:
                raise RuntimeError("quantize_model must come before pack_weights")
    observed = tuple(name for name in QUANTIZED if outliers.get(name, 0) > 0)
    absmax = activation_absmax(model, observed) if observed else {}
    for i, layer in enumerate(model.layers):
        for name in QUANTIZED:
            weight = getattr(layer, name)
            delattr(layer, name)  # a Parameter: the module takes its place
            count = outliers.get(name, 0)
            setattr(layer, name, Int8Linear(weight, absmax.get((i, name)), count))
