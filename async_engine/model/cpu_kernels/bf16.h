// Helpers shared by the CPU attention kernels: bf16 <-> float32, a vectorisable exp, and
// (with AVX-512) a 16-way horizontal sum, (with AVX512-BF16) vector loads and a row prefetch.
#pragma once
// GCC 12's AVX-512 intrinsics start from `__m512 __Y = __Y;` (_mm512_undefined_ps), which
// -Wall reports as maybe-uninitialized at every inlined use (GCC bug 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kernels {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
    uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
// exp(x) for the softmax (x <= 0), in plain arithmetic so that the loops using it vectorise
// without -ffast-math: x = n ln2 + r, e^r by a degree-6 polynomial, 2^n in the exponent bits.
// Relative error under 2e-7 over the range a softmax needs; underflows to 0 below -87.
inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) {
        p[i] = static_cast<uint16_t>((bits >> 16) | 0x40u);  // keep NaN a NaN
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even, as torch does
    p[i] = static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512F__)
// Lane i of the result: the sum of v[i]'s 16 lanes.
inline __m512 sum16(const __m512* v) {
    __m512 u[4];
    for (int k = 0; k < 4; ++k) {
        const __m512* w = v + 4 * k;
        // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for the pairs (a, b).
        const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]),
                                        _mm512_unpackhi_ps(w[0], w[1]));
        const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]),
                                        _mm512_unpackhi_ps(w[2], w[3]));
        // Per 128-bit lane: that lane's sums of w[0], w[1], w[2], w[3].
        u[k] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
    }
    // Add the four 128-bit lanes of each u[k], landing u[k]'s totals in lane k.
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                     _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                     _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88),
                         _mm512_shuffle_f32x4(x01, x23, 0xDD));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KERNELS_BF16_FAST 1

inline __m512bh load_bf16x32(const uint16_t* p) {
    return (__m512bh)_mm512_loadu_si512(static_cast<const void*>(p));
}

inline __m512 load_bf16x16(const uint16_t* p) {
    return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Asks for the K or V rows of positions [p0, p0 + 16) ahead of use: the cache comes from
// DRAM, and waiting for each line as it is touched left the core idle most of the time.
template <int HINT>
inline void prefetch_chunk(const uint16_t* cache, const int64_t* offsets, int64_t p0,
                           int64_t ctx, int64_t row_bytes) {
    const int64_t end = p0 + 16 < ctx ? p0 + 16 : ctx;
    for (int64_t pos = p0; pos < end; ++pos) {
        const char* row = reinterpret_cast<const char*>(cache + offsets[pos]);
        for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, (_mm_hint)HINT);
    }
}

#endif

}  // namespace kernels
