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
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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
// As int16 (Q), the same values without the zero point, for the AVX2 matmul.
template <typename T, typename Q>
static inline void quantize_row(const T* row, const float* m, int64_t cols, Q* out,
                                float* scale) {
  constexpr int32_t zero = sizeof(Q) == 1 ? 128 : 0;
  uint32_t top = 0;
  for (int64_t c = 0; c < cols; ++c) {
    uint32_t a = abs_bits(load(row, c) * m[c]);
    top = a > top ? a : top;
  }
  float amax;
  std::memcpy(&amax, &top, 4);
  float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t c = 0; c < cols; ++c) {
    float v = (load(row, c) * m[c] * inv + 12582912.f) - 12582912.f;
    out[c] = Q(int32_t(v > 127.f ? 127.f : (v < -127.f ? -127.f : v)) + zero);
  }
  *scale = amax > 0.f ? amax / 127.f : 1.f;
}

template <typename T>
static void quantize(const T* x, const float* m, int64_t rows, int64_t cols, uint8_t* q,
                     float* scales) {
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) quantize_row(x + r * cols, m, cols, q + r * cols, scales + r);
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

#if defined(__AVX2__)
// The int8 matmul for AVX2 without VNNI, where oneDNN's int8 is no faster than its float32.
// Exact int32 sums: each weight byte is widened to int16 as it is loaded (vpmovsxbw) and
// vpmaddwd multiplies an input pair (k, k+1), broadcast, by eight channels' pairs and adds the
// two products into int32: 16 multiply-adds in two ops (vpmaddwd + vpaddd), where the
// vpmaddubsw route (u8 x s8) needs a vpsignb too, and saturates beyond 7-bit inputs. Weights
// are packed by pack_avx2 (Python) into panels of 8 channels: [panel][k pair][channel][2].
// A tile is R rows x 16 channels (two panels): 2R accumulators + 2 weights + 1 input fill
// the 16 ymm registers, and each weight load feeds R rows (R = 6 measured best of 4..8).
// Accumulators are named, not an array: GCC spills an array of __m256i to the stack.
#define INT8_ROW(i)                                                                 \
  if constexpr (R > i) {                                                            \
    int32_t pair;                                                                   \
    std::memcpy(&pair, x + i * ldx + 2 * j, 4);                                     \
    __m256i xv = _mm256_set1_epi32(pair);                                           \
    a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(xv, w0));                       \
    if constexpr (C > 1) b##i = _mm256_add_epi32(b##i, _mm256_madd_epi16(xv, w1)); \
  }
#define INT8_STORE(i)                                                           \
  if constexpr (R > i) {                                                        \
    _mm256_storeu_si256((__m256i*)(sums + i * 16), a##i);                       \
    if constexpr (C > 1) _mm256_storeu_si256((__m256i*)(sums + i * 16 + 8), b##i); \
  }
constexpr int INT8_R = 6;

// sums[i * 16 + c] = sum_k x[i, k] * w[c, k] for R rows and 8 * C channels.
template <int R, int C>
static inline void int8_tile(const int16_t* x, int64_t ldx, const int8_t* w, int64_t panel,
                             int64_t pairs, int32_t* sums) {
  static_assert(R >= 1 && R <= INT8_R && (C == 1 || C == 2), "tile shape");
  __m256i z = _mm256_setzero_si256();
  __m256i a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z;
  __m256i b0 = z, b1 = z, b2 = z, b3 = z, b4 = z, b5 = z;
#pragma GCC unroll 2
  for (int64_t j = 0; j < pairs; ++j) {
    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + j * 16)));
    __m256i w1 = w0;
    if constexpr (C > 1)
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + panel + j * 16)));
    INT8_ROW(0) INT8_ROW(1) INT8_ROW(2) INT8_ROW(3) INT8_ROW(4) INT8_ROW(5)
  }
  INT8_STORE(0) INT8_STORE(1) INT8_STORE(2) INT8_STORE(3) INT8_STORE(4) INT8_STORE(5)
}

// All m rows of x ([m, ldx] int16) against the column block at c0 (16 channels, fewer in the
// last), 6 rows at a time: the block's weights (16 x k bytes) stay in L1 while the rows
// stream past. finish(r0, rows, sums) takes each tile's int32 sums ([rows, 16]).
template <typename Finish>
static void int8_block(const int16_t* x, int64_t m, int64_t ldx, const int8_t* w, int64_t n,
                       int64_t c0, Finish&& finish) {
  int64_t pairs = ldx / 2, panel = pairs * 16;
  const int8_t* wb = w + (c0 / 8) * panel;
  alignas(32) int32_t sums[INT8_R * 16];
  auto tile = [&](auto rows, int64_t r0) {
    constexpr int R = decltype(rows)::value;
    if (n - c0 > 8)
      int8_tile<R, 2>(x + r0 * ldx, ldx, wb, panel, pairs, sums);
    else  // a last block of one panel
      int8_tile<R, 1>(x + r0 * ldx, ldx, wb, panel, pairs, sums);
    finish(r0, int64_t(R), sums);
  };
  int64_t r = 0;
  for (; r + INT8_R <= m; r += INT8_R) tile(std::integral_constant<int, INT8_R>(), r);
  switch (m - r) {
    case 1: tile(std::integral_constant<int, 1>(), r); break;
    case 2: tile(std::integral_constant<int, 2>(), r); break;
    case 3: tile(std::integral_constant<int, 3>(), r); break;
    case 4: tile(std::integral_constant<int, 4>(), r); break;
    case 5: tile(std::integral_constant<int, 5>(), r); break;
    default: break;
  }
}

// One row of a tile, 16 columns: y = float(sums) * wscale * s + bias + xo . ow[:, c], in
// epilogue_block's order of operations (so the same bits as the epilogue after oneDNN).
template <typename T>
static inline void int8_finish16(const int32_t* sums, const float* wscale, float s,
                                 const float* bias, const float* xo, int64_t nout,
                                 const float* ow, int64_t n, T* y) {
  __m256 sv = _mm256_set1_ps(s);
  __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)sums)),
                            _mm256_loadu_ps(wscale));
  __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(sums + 8))),
                            _mm256_loadu_ps(wscale + 8));
  t0 = _mm256_mul_ps(t0, sv);
  t1 = _mm256_mul_ps(t1, sv);
  if (bias) {
    t0 = _mm256_add_ps(t0, _mm256_loadu_ps(bias));
    t1 = _mm256_add_ps(t1, _mm256_loadu_ps(bias + 8));
  }
  for (int64_t c = 0; c < nout; ++c) {
    __m256 xv = _mm256_set1_ps(xo[c]);
    t0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(ow + c * n), t0);
    t1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(ow + c * n + 8), t1);
  }
  alignas(32) float t[16];
  _mm256_store_ps(t, t0);
  _mm256_store_ps(t + 8, t1);
  for (int64_t j = 0; j < 16; ++j) store(y, j, t[j]);
}

// Int8Linear's forward in one call: quantize_rows (as int16), the matmul and the epilogue,
// each tile's sums finished while in L1; one OpenMP region for both loops.
template <typename T>
static void int8_linear(const T* x, const float* mask, int64_t m, int64_t k, const int8_t* w,
                        int64_t n, const float* wscale, const int64_t* idx, int64_t nout,
                        const float* ow, const float* bias, T* y, int threads) {
  int64_t ldx = (k + 1) / 2 * 2;  // whole pairs: the padding column is 0 in x and w
  std::vector<int16_t> q(m * ldx, 0);
  std::vector<float> rs(m), xo(m * nout);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < nout; ++c) xo[r * nout + c] = load(x + r * k, idx[c]);
  int64_t blocks = (n + 15) / 16;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) quantize_row(x + r * k, mask, k, q.data() + r * ldx, &rs[r]);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      int64_t c0 = b * 16, cols = n - c0 < 16 ? n - c0 : 16;
      const float* bb = bias ? bias + c0 : nullptr;
      int8_block(q.data(), m, ldx, w, n, c0, [&](int64_t r0, int64_t rows, const int32_t* sums) {
        for (int64_t r = r0; r < r0 + rows; ++r) {
          const int32_t* sr = sums + (r - r0) * 16;
          const float* xr = xo.data() + r * nout;
          if (cols == 16) {
            int8_finish16(sr, wscale + c0, rs[r], bb, xr, nout, ow + c0, n, y + r * n + c0);
            continue;
          }
          for (int64_t c = 0; c < cols; ++c) {  // the last, narrower block
            float a = float(sr[c]) * wscale[c0 + c];
            epilogue_block<T, 1>(&a, rs[r], xr, nout, ow + c0 + c, n, bb ? bb + c : nullptr,
                                 y + r * n + c0 + c);
          }
        }
      });
    }
  }
}

extern "C" {
// out[r, c] = sum_k (qx[r, k] - 128) * w[c, k], exact int32: qx [m, k] uint8 (quantize_rows),
// w: pack_avx2's panels of n channels, out: [m, n]. For tests; Int8Linear runs int8_linear.
void int8_matmul_avx2(const uint8_t* qx, int64_t m, int64_t k, const int8_t* w, int64_t n,
                      int32_t* out, int threads) {
  int64_t ldx = (k + 1) / 2 * 2;
  std::vector<int16_t> x(m * ldx, 0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) x[r * ldx + c] = int16_t(int16_t(qx[r * k + c]) - 128);
  int64_t blocks = (n + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t c0 = b * 16, cols = n - c0 < 16 ? n - c0 : 16;
    int8_block(x.data(), m, ldx, w, n, c0, [&](int64_t r0, int64_t rows, const int32_t* sums) {
      for (int64_t i = 0; i < rows; ++i)
        std::memcpy(out + (r0 + i) * n + c0, sums + i * 16, cols * 4);
    });
  }
}
void int8_linear_avx2_f32(const float* x, const float* mask, int64_t m, int64_t k,
                          const int8_t* w, int64_t n, const float* wscale, const int64_t* idx,
                          int64_t nout, const float* ow, const float* bias, float* y,
                          int threads) {
  int8_linear(x, mask, m, k, w, n, wscale, idx, nout, ow, bias, y, threads);
}
void int8_linear_avx2_bf16(const uint16_t* x, const float* mask, int64_t m, int64_t k,
                           const int8_t* w, int64_t n, const float* wscale, const int64_t* idx,
                           int64_t nout, const float* ow, const float* bias, uint16_t* y,
                           int threads) {
  int8_linear(x, mask, m, k, w, n, wscale, idx, nout, ow, bias, y, threads);
}
}
#endif

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


def _isa() -> str:
    """``ASYNC_ENGINE_CPU_ISA=avx2`` builds for AVX2 as the CPU kernels do (cpu_kernels/build)."""
    isa = os.environ.get("ASYNC_ENGINE_CPU_ISA") or "native"
    return isa if isa in ISA_FLAGS else "native"


def _library_path(isa: str) -> Path:
    root = os.environ.get("ASYNC_ENGINE_CACHE") or Path.home() / ".cache" / "async-engine"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(sorted({ln for ln in lines if ln.startswith(("flags", "model name"))}))
    except OSError:
        cpu = "unknown-cpu"
    key = hashlib.sha256("\n".join((SOURCE, *FLAGS, *ISA_FLAGS[isa], cpu)).encode()).hexdigest()
    return Path(root) / "cpu-kernels" / f"int8-{key[:16]}.so"


def _build(target: Path, isa: str) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "int8.cpp", Path(tmp) / "int8.so"
        src.write_text(SOURCE)
        argv = [compiler, *FLAGS, *ISA_FLAGS[isa], str(src), "-o", str(out)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: a parallel build never tears it


@functools.cache
def load(isa: str) -> ctypes.CDLL | None:
    """The loops built for ``isa`` ("native" or "avx2"), or None (logged once) where they
    cannot be built. Both may be loaded in one process (the tests compare them)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be {'|'.join(ISA_FLAGS)}, got {isa!r}")
    try:
        path = _library_path(isa)
        if not path.exists():
            _build(path, isa)
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
    return load(_isa())


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
        x.data_ptr(), mask.data_ptr(), rows, k, packed.data_ptr(), n, scale.data_ptr(),
        index.data_ptr(), index.numel(), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return y
