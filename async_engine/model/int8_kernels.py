"""The two loops around the int8 matmul in ``Int8Linear``, one C++ pass each, and the matmul
itself for CPUs with AVX2 but no int8 dot products (``matmul_avx2``).

- ``quantize_rows``: each input row (token) times the column mask, as int8 with one scale.
- ``epilogue``: the matmul's float32 sums times the row scales, plus the outlier channels'
  float matmul and the bias, rounded once into the activations' dtype.
- ``linear_avx2`` (weights from ``pack_avx2``): the three in one call, the matmul's exact
  int32 sums by vpmaddwd, for AVX2 without VNNI, where oneDNN's int8 was slower than its
  float32 (the kernel alone: 1.7x oneDNN's float32 at 40 rows; ``matmul_avx2``: its sums).

In torch they are ten-odd ops per matmul, ~100 us at a decode batch of 32 in bfloat16
(measured), paid 120 times a step by the default model: more than int8 saves. Compiled on
first use from ``cpu_kernels/int8_matmul.cpp`` with the system's ``g++`` (``-O3
-march=native``, about a second) into the CPU kernels' cache (``cpu_kernels/build``, rebuilt
when the source changes); without a compiler, or with ``ASYNC_ENGINE_CPU_KERNELS=0``, the
torch ops run. Large inputs spread over torch's OpenMP threads; a decode batch's quantization
stays on one (a few microseconds).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess

import torch

from .cpu_kernels.build import HERE, build, library_path, selected_isa

log = logging.getLogger("async_engine.model")
# No FMA contraction: x * m * inv + 1.5 * 2^23 must round the product first, as torch does
# (the epilogue asks for its FMAs by name).
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
ISA_FLAGS = {"native": ("-march=native", "-mprefer-vector-width=512"), "avx2": ("-march=haswell",)}
SOURCE = HERE / "int8_matmul.cpp"
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
ZERO_POINT = 128


def flags(isa: str) -> tuple[str, ...]:
    return (*FLAGS, *ISA_FLAGS[isa])


@functools.cache
def load(isa: str) -> ctypes.CDLL | None:
    """The loops built for ``isa`` ("native" or "avx2"), or None (logged once) where they
    cannot be built. Both may be loaded in one process (the tests compare them)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be {'|'.join(ISA_FLAGS)}, got {isa!r}")
    try:
        path = library_path(isa, name="int8", inputs=(SOURCE,), compile_flags=flags(isa))
        if not path.exists():
            build(path, isa, sources=(SOURCE,), compile_flags=flags(isa))
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("int8 kernels unavailable, using torch ops: %s", exc)
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for suffix in SUFFIX.values():
        rows, post = getattr(lib, f"int8_rows_{suffix}"), getattr(lib, f"int8_epilogue_{suffix}")
        rows.restype = post.restype = None
        rows.argtypes = [ptr, ptr, i64, i64, ptr, ptr]
        post.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, ptr]
    if hasattr(lib, "int8_matmul_avx2"):  # compiled for a CPU with AVX2 only
        lib.int8_matmul_avx2.restype = None
        lib.int8_matmul_avx2.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
        for suffix in SUFFIX.values():
            fn = getattr(lib, f"int8_linear_avx2_{suffix}")
            fn.restype = None
            fn.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled loops for ``ASYNC_ENGINE_CPU_ISA`` (read once), or None where they are
    off (``ASYNC_ENGINE_CPU_KERNELS=0``) or cannot be built."""
    if os.environ.get("ASYNC_ENGINE_CPU_KERNELS", "1") == "0":
        return None
    isa = selected_isa()  # ASYNC_ENGINE_CPU_ISA=avx2 builds for AVX2 as the CPU kernels do
    return load(isa if isa in ISA_FLAGS else "native")


def _kernel(x: torch.Tensor) -> ctypes.CDLL | None:
    """The library where it takes ``x``: a 2-D CPU float32 or bfloat16 matrix."""
    ok = x.dtype in SUFFIX and x.device.type == "cpu" and x.dim() == 2
    return library() if ok else None


def quantize_rows_torch(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``quantize_rows``."""
    x = x.float() * mask
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    # 127 / amax on a tensor is reciprocal(amax) * 127 in torch: divide as the kernel does.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(x * inv).clamp_(-127, 127) + ZERO_POINT).to(torch.uint8), scale


def quantize_rows(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * mask`` ([rows, cols] float32 or bfloat16, ``mask`` float32 [cols]) as int8
    rows and float32 scales [rows, 1]: ``round(x * mask / scale)``, symmetric per row, stored
    as uint8 with ``ZERO_POINT`` added (oneDNN's fast int8 matmuls without AMX want an
    unsigned source: a signed one was 4x to 4000x slower under AVX2 and AVX512-VNNI)."""
    lib = _kernel(x)
    if lib is None:
        return quantize_rows_torch(x, mask)
    x, mask = x.contiguous(), mask.float().contiguous()
    if mask.shape != x.shape[1:]:
        raise ValueError(f"mask {tuple(mask.shape)} for rows of {x.shape[1]}")
    q = torch.empty(x.shape, dtype=torch.uint8)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32)
    fn = getattr(lib, f"int8_rows_{SUFFIX[x.dtype]}")
    fn(x.data_ptr(), mask.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), scale.data_ptr())
    return q, scale


def epilogue_torch(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The reference of ``epilogue``."""
    y = acc * row_scale
    if index.numel():
        y.addmm_(x.index_select(1, index).float(), weight)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def epilogue(
    acc: torch.Tensor,  # [rows, n] float32: the int8 matmul's sums times the weight scales
    row_scale: torch.Tensor,  # [rows, 1] float32
    x: torch.Tensor,  # [rows, cols]: the matmul's input, whose ``index`` columns are added
    index: torch.Tensor,  # [k] int64
    weight: torch.Tensor,  # [k, n] float32: those columns' weights
    bias: torch.Tensor | None,  # [n]
) -> torch.Tensor:
    """``acc * row_scale + x[:, index] @ weight + bias`` in ``x``'s dtype, rounded once."""
    lib = _kernel(x)
    exact = acc.dtype == weight.dtype == torch.float32 and index.dtype == torch.int64
    if lib is None or not exact:
        return epilogue_torch(acc, row_scale, x, index, weight, bias)
    acc, row_scale, x = acc.contiguous(), row_scale.float().contiguous(), x.contiguous()
    index, weight = index.contiguous(), weight.contiguous()
    rows, n = acc.shape
    bias = None if bias is None else bias.float().contiguous()
    y = torch.empty(rows, n, dtype=x.dtype)
    getattr(lib, f"int8_epilogue_{SUFFIX[x.dtype]}")(
        acc.data_ptr(),
        row_scale.data_ptr(),
        x.data_ptr(),
        x.shape[1],
        index.data_ptr(),
        index.numel(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        rows,
        n,
        y.data_ptr(),
    )
    return y


def has_matmul_avx2() -> bool:
    """Whether ``matmul_avx2`` can run: the loops are built, and for a CPU with AVX2."""
    lib = library()
    return lib is not None and hasattr(lib, "int8_matmul_avx2")


def pack_avx2(q: torch.Tensor) -> torch.Tensor:
    """An int8 weight [n, k] in ``matmul_avx2``'s layout: panels of 8 output channels, each
    [k pairs, 8 channels, 2] so one 16-byte load holds an input pair for 8 channels; k padded
    to even and n to a multiple of 8 with zeros."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"pack_avx2 takes an int8 [n, k] weight, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    panels, pairs = (n + 7) // 8, (k + 1) // 2
    padded = torch.zeros(panels * 8, pairs * 2, dtype=torch.int8)
    padded[:n, :k] = q
    return padded.view(panels, 8, pairs, 2).permute(0, 2, 1, 3).contiguous()


def _packed_shape(n: int, k: int) -> tuple[int, int, int, int]:
    return ((n + 7) // 8, (k + 1) // 2, 8, 2)


def matmul_avx2(qx: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``(qx - ZERO_POINT) @ q.T`` as exact int32 [rows, n], for ``packed = pack_avx2(q)``
    with ``n`` output channels and ``qx`` from ``quantize_rows``: the sums ``linear_avx2``
    finishes, for the tests."""
    if not has_matmul_avx2():
        raise ValueError("matmul_avx2 needs the int8 kernels built for a CPU with AVX2")
    if qx.dtype != torch.uint8 or qx.dim() != 2:
        raise ValueError(f"matmul_avx2 takes uint8 [rows, k] inputs, got {qx.dtype} {qx.shape}")
    rows, k = qx.shape
    if packed.dtype != torch.int8 or packed.shape != _packed_shape(n, k):
        raise ValueError(f"packed weight {tuple(packed.shape)} is not pack_avx2 of [{n}, {k}]")
    qx, packed = qx.contiguous(), packed.contiguous()
    out = torch.empty(rows, n, dtype=torch.int32)
    library().int8_matmul_avx2(
        qx.data_ptr(), rows, k, packed.data_ptr(), n, out.data_ptr(), torch.get_num_threads()
    )
    return out


def linear_avx2(
    x: torch.Tensor,  # [rows, k] float32 or bfloat16
    mask: torch.Tensor,  # [k] float32: quantize_rows' column mask
    packed: torch.Tensor,  # pack_avx2 of the int8 weight [n, k]
    scale: torch.Tensor,  # [n] float32: the weight scales
    index: torch.Tensor,  # [outliers] int64: the columns of x added in float
    weight: torch.Tensor,  # [outliers, n] float32: their weights
    bias: torch.Tensor | None,  # [n]
) -> torch.Tensor:
    """``epilogue(dequantized matmul_avx2(quantize_rows(x, mask)), ...)`` in one call: the
    same arithmetic, each tile's sums finished while in cache, one ctypes call per layer."""
    if not has_matmul_avx2():
        raise ValueError("linear_avx2 needs the int8 kernels built for a CPU with AVX2")
    if x.dtype not in SUFFIX or x.dim() != 2:
        raise ValueError(f"linear_avx2 takes float32 or bfloat16 [rows, k], got {x.dtype}")
    (rows, k), n = x.shape, scale.shape[0]
    if packed.dtype != torch.int8 or packed.shape != _packed_shape(n, k):
        raise ValueError(f"packed weight {tuple(packed.shape)} is not pack_avx2 of [{n}, {k}]")
    if mask.shape != (k,) or index.dtype != torch.int64 or weight.shape != (index.numel(), n):
        raise ValueError(f"mask {tuple(mask.shape)}, outlier weight {tuple(weight.shape)}")
    # Held in locals until the call returns: the kernel reads their memory.
    x, mask, packed = x.contiguous(), mask.float().contiguous(), packed.contiguous()
    scale, index = scale.float().contiguous(), index.contiguous()
    weight = weight.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    y = torch.empty(rows, n, dtype=x.dtype)
    getattr(library(), f"int8_linear_avx2_{SUFFIX[x.dtype]}")(
        x.data_ptr(),
        mask.data_ptr(),
        rows,
        k,
        packed.data_ptr(),
        n,
        scale.data_ptr(),
        index.data_ptr(),
        index.numel(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y
