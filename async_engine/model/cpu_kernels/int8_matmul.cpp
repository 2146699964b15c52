// The loops around the int8 matmul of Int8Linear (async_engine/model/int8_kernels.py), and the
// matmul itself for CPUs with AVX2 but no int8 dot products. Its own library, built with
// int8_kernels.FLAGS: -ffp-contract=off, since x * m * inv + 1.5 * 2^23 must round the product
// first, as torch does (the epilogue asks for its FMAs by name).
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
