// Float32 vectors of the widest ISA the build targets, for the kernels that run in float32
// whatever the storage: AVX-512 (16 lanes) or AVX2 with FMA and F16C (8 lanes, the AMD EPYCs
// and Intel cores without AVX-512). bf16 and fp16 operands are widened in registers as they
// load, so a half-precision cache moves half the bytes of a float32 one.
#pragma once
#include "bf16.h"
#include "kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define KERNELS_VEC 1
#include <immintrin.h>

namespace kernels {

struct Half {  // IEEE fp16 storage; a distinct type so that overloads pick its widening
    uint16_t bits;
};

inline float load(const Half* p, int64_t i) { return _cvtsh_ss(p[i].bits); }
inline void store(Half* p, int64_t i, float x) {
    p[i].bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

#if defined(__AVX512F__)
constexpr int W = 16;     // lanes
constexpr int NREG = 32;  // vector registers: sets how many accumulators a loop may hold
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const uint16_t* p) {  // bf16: its bits are a float's upper half
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload(const Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
// bf16, rounded to nearest even as the scalar `store` rounds.
inline void vstore(uint16_t* p, vf x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
}
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
// Lanes where x < 0 take a, the others b.
inline vf where_negative(vf x, vf a, vf b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), b, a);
}
inline float hsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float hmax(vf x) { return _mm512_reduce_max_ps(x); }
// Lanes at or past n (0 <= n <= W) become `fill`.
inline vf keep_first(vf x, int n, float fill) {
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), m, x);
}
inline vf round_even(vf x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vf pow2i(vf n) {  // 2^n for integral n in the normal range
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
// Lane i of the result: the sum of v[i]'s lanes (W vectors summed at once, in registers).
inline vf sum_lanes(const vf* v) { return sum16(v); }
#else
constexpr int W = 8;
constexpr int NREG = 16;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vload(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline void vstore(uint16_t* p, vf x) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
    const __m256i r = _mm256_srli_epi32(up, 16);  // each lane < 2^16: packus keeps it exactly
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf where_negative(vf x, vf a, vf b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
inline float hsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(vf x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vf keep_first(vf x, int n, float fill) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, keep);
}
inline vf round_even(vf x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vf pow2i(vf n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
// Lane i: the sum of v[i]'s 8 lanes. hadd pairs neighbours; the last step adds the halves.
inline vf sum_lanes(const vf* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// exp(x) for x <= 0: fast_exp's polynomial (bf16.h), W lanes at a time.
inline vf vexp(vf x) {
    x = vmax(x, vset1(-87.0f));
    const vf n = round_even(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(vmul(p, r), r, vadd(r, vset1(1.0f)));
    return vmul(p, pow2i(n));
}

// Asks for `bytes` at each of rows [p0, end) + `at` ahead of use: the cache comes from DRAM,
// and waiting for each line as it is touched leaves the core idle most of the time.
template <int HINT, typename C>
inline void prefetch_rows(const C* cache, const int64_t* offsets, int64_t p0, int64_t end,
                          int64_t at, int64_t bytes) {
    for (int64_t pos = p0; pos < end; ++pos) {
        const char* row = reinterpret_cast<const char*>(cache + offsets[pos] + at);
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, (_mm_hint)HINT);
    }
}

// Calls f(T*, C*) with null pointers of the element types the codes name (bf16 is uint16_t,
// fp16 Half): the one place that turns runtime dtype codes into template arguments.
template <typename F>
bool with_types(DType qt, DType kt, F&& f) {
    float* f32 = nullptr;
    uint16_t* bf16 = nullptr;
    Half* f16 = nullptr;
    if (qt == F32 && kt == F32) return f(f32, f32);
    if (qt == F32 && kt == BF16) return f(f32, bf16);
    if (qt == F32 && kt == F16) return f(f32, f16);
    if (qt == BF16 && kt == BF16) return f(bf16, bf16);
    if (qt == F16 && kt == F16) return f(f16, f16);
    return false;
}

}  // namespace kernels
#endif
