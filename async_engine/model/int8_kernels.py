"""The two loops around oneDNN's int8 matmul in ``Int8Linear``, one C++ pass each.

- ``quantize_rows``: each input row (token) times the column mask, as int8 with one scale.
- ``epilogue``: the matmul's float32 sums times the row scales, plus the outlier channels'
  float matmul and the bias, rounded once into the activations' dtype.

In torch they are ten-odd ops per matmul, ~100 us at a decode batch of 32 in bfloat16
(measured), paid 120 times a step by the default model: more than int8 saves. Compiled on
first use with the system's ``g++`` (``-O3 -march=native``, about a second) into the CPU
kernels' cache folder; without a compiler, or with ``ASYNC_ENGINE_CPU_KERNELS=0``, the torch
ops run. Large inputs spread over torch's OpenMP threads; a decode batch's quantization
stays on one (a few microseconds).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("async_engine.model")
# No FMA contraction: x * m * inv + 1.5 * 2^23 must round the product first, as torch does
# (the epilogue asks for its FMAs by name).
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
ISA_FLAGS = {"native": ("-march=native", "-mprefer-vector-width=512"), "avx2": ("-march=haswell",)}
SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

static inline float load(const float* x, int64_t i) { return x[i]; }
static inline float load(const uint16_t* x, int64_t i) {
  uint32_t bits = uint32_t(x[i]) << 16;  // bfloat16 is float32's upper half
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static inline void store(float* y, int64_t i, float v) { y[i] = v; }
static inline void store(uint16_t* y, int64_t i, float v) {  // round to nearest even, as torch
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  y[i] = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
static inline uint32_t abs_bits(float v) {  // |v|'s bits: ordered as |v| is, and max-reducible
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits & 0x7fffffffu;
}

// Row r times the column mask m, symmetric int8 stored as uint8 with zero point 128:
// q = round(x*m * 127 / amax) + 128, ties to even (adding and removing 1.5 * 2^23 rounds
// |v| < 2^22 in plain, vectorizable float ops); scale = amax / 127, or 1 for a zero row.
template <typename T>
static void quantize(const T* x, const float* m, int64_t rows, int64_t cols, uint8_t* q,
                     float* scales) {
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * cols;
    uint32_t top = 0;
    for (int64_t c = 0; c < cols; ++c) {
      uint32_t a = abs_bits(load(row, c) * m[c]);
      top = a > top ? a : top;
    }
    float amax;
    std::memcpy(&amax, &top, 4);
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    uint8_t* out = q + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      float v = (load(row, c) * m[c] * inv + 12582912.f) - 12582912.f;
      out[c] = uint8_t(int32_t(v > 127.f ? 127.f : (v < -127.f ? -127.f : v)) + 128);
    }
    scales[r] = amax > 0.f ? amax / 127.f : 1.f;
  }
}

// y[r] = acc[r] * s[r] + bias + sum_c x[r, idx[c]] * w[c]   (w: [k, n] float32)
// In column blocks of J held in registers across the k outlier rows of w: w is then the only
// stream, loaded once per row of y.
constexpr int64_t J = 64;
template <typename T, int64_t Width>
static inline void epilogue_block(const float* a, float s, const float* xo, int64_t k,
                                  const float* w, int64_t n, const float* bias, T* y) {
  float t[Width];
  for (int64_t j = 0; j < Width; ++j) t[j] = a[j] * s + (bias ? bias[j] : 0.f);
  for (int64_t c = 0; c < k; ++c)
    for (int64_t j = 0; j < Width; ++j) t[j] = std::fma(xo[c], w[c * n + j], t[j]);
  for (int64_t j = 0; j < Width; ++j) store(y, j, t[j]);
}

// Rows x column blocks spread over the OpenMP threads (torch's runtime: libgomp.so.1 is the
// one torch loaded) once there is enough work to pay for waking them.
template <typename T>
static void epilogue(const float* acc, const float* s, const T* x, int64_t x_cols,
                     const int64_t* idx, int64_t k, const float* w, const float* bias,
                     int64_t rows, int64_t n, T* y) {
  std::vector<float> xo(rows * k);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) xo[r * k + c] = load(x + r * x_cols, idx[c]);
  int64_t blocks = (n + J - 1) / J;
#pragma omp parallel for schedule(static) if (rows * n * (k + 2) > (1 << 16))
  for (int64_t task = 0; task < rows * blocks; ++task) {
    int64_t r = task / blocks, j = (task % blocks) * J;
    const float* a = acc + r * n + j;
    const float* b = bias ? bias + j : nullptr;
    if (j + J <= n) {
      epilogue_block<T, J>(a, s[r], xo.data() + r * k, k, w + j, n, b, y + r * n + j);
    } else {
      for (int64_t t = 0; j + t < n; ++t)  // the tail, one column at a time
        epilogue_block<T, 1>(a + t, s[r], xo.data() + r * k, k, w + j + t, n,
                             b ? b + t : nullptr, y + r * n + j + t);
    }
  }
}

extern "C" {
void int8_rows_f32(const float* x, const float* m, int64_t rows, int64_t cols, uint8_t* q,
                   float* s) {
  quantize(x, m, rows, cols, q, s);
}
void int8_rows_bf16(const uint16_t* x, const float* m, int64_t rows, int64_t cols, uint8_t* q,
                    float* s) {
  quantize(x, m, rows, cols, q, s);
}
void int8_epilogue_f32(const float* acc, const float* s, const float* x, int64_t x_cols,
                       const int64_t* idx, int64_t k, const float* w, const float* bias,
                       int64_t rows, int64_t n, float* y) {
  epilogue(acc, s, x, x_cols, idx, k, w, bias, rows, n, y);
}
void int8_epilogue_bf16(const float* acc, const float* s, const uint16_t* x, int64_t x_cols,
                        const int64_t* idx, int64_t k, const float* w, const float* bias,
                        int64_t rows, int64_t n, uint16_t* y) {
  epilogue(acc, s, x, x_cols, idx, k, w, bias, rows, n, y);
}
}
"""
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
ZERO_POINT = 128


def _flags() -> tuple[str, ...]:
    """``ASYNC_ENGINE_CPU_ISA=avx2`` builds for AVX2 as the CPU kernels do (cpu_kernels/build)."""
    isa = os.environ.get("ASYNC_ENGINE_CPU_ISA") or "native"
    return (*FLAGS, *ISA_FLAGS.get(isa, ISA_FLAGS["native"]))


def _library_path() -> Path:
    root = os.environ.get("ASYNC_ENGINE_CACHE") or Path.home() / ".cache" / "async-engine"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(sorted({ln for ln in lines if ln.startswith(("flags", "model name"))}))
    except OSError:
        cpu = "unknown-cpu"
    key = hashlib.sha256("\n".join((SOURCE, *_flags(), cpu)).encode()).hexdigest()[:16]
    return Path(root) / "cpu-kernels" / f"int8-{key}.so"


def _build(target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "int8.cpp", Path(tmp) / "int8.so"
        src.write_text(SOURCE)
        argv = [compiler, *_flags(), str(src), "-o", str(out)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: a parallel build never tears it


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled loops, or None (logged once) where they are off or cannot be built."""
    if os.environ.get("ASYNC_ENGINE_CPU_KERNELS", "1") == "0":
        return None
    try:
        path = _library_path()
        if not path.exists():
            _build(path)
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
    return lib


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
        acc.data_ptr(), row_scale.data_ptr(), x.data_ptr(), x.shape[1],
        index.data_ptr(), index.numel(), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), rows, n, y.data_ptr(),
    )  # fmt: skip
    return y
