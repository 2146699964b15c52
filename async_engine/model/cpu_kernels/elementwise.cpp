// The elementwise parts of a decoder layer, each one pass over memory instead of the several
// torch runs on CPU (F.rms_norm alone decomposes into five ops there): float32 math inside,
// one rounding at the end for bf16. Rows are split over OpenMP threads; the loops are
// written so that the compiler vectorises them for the build's ISA (AVX2 or AVX-512).
#include "bf16.h"
#include "vec.h"

namespace {
using namespace kernels;

// x * sigmoid(x) without overflow: exp only ever sees a non-positive argument.
inline float silu(float x) {
    const float e = fast_exp(x < 0.0f ? x : -x);
    const float sig = x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
    return x * sig;
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; x rows `x_stride` elements apart.
template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* weight, int64_t rows, int64_t width,
              float eps, T* out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * x_stride;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < width; ++i) {
            const float v = load(xr, i);
            ss += v * v;
        }
        const float scale = 1.0f / std::sqrt(ss / static_cast<float>(width) + eps);
        T* o = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) store(o, i, load(xr, i) * scale * load(weight, i));
    }
}

#if defined(KERNELS_VEC)
// silu(g) * u for W lanes: the scalar silu's formula, with vec.h's exp (the compiler does not
// vectorise the scalar one's rounding, and exp is most of the work).
inline vf silu_times(vf g, vf u) {
    const vf one = vset1(1.0f);
    const vf e = vexp(vmin(g, vsub(vzero(), g)));  // exp(-|g|)
    const vf sig = vdiv(where_negative(g, e, one), vadd(one, e));
    return vmul(vmul(g, sig), u);
}
#endif

// out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:].
template <typename T>
void silu_mul(const T* gate_up, int64_t rows, int64_t inter, T* out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * inter;
        T* o = out + r * inter;
        int64_t i = 0;
#if defined(KERNELS_VEC)
        for (; i + W <= inter; i += W) {
            vstore(o + i, silu_times(vload(g + i), vload(g + inter + i)));
        }
#endif
        for (; i < inter; ++i) store(o, i, silu(load(g, i)) * load(g, inter + i));
    }
}

// Rotate-half RoPE on `heads` heads of each token: out = x * cos + roll(x, D/2) * sin, where
// sin is sign-folded ([-sin, sin]) like the model's. x rows (tokens) are `x_stride` apart;
// cos and sin are [tokens, D]; out is [tokens, heads, D].
template <typename T>
void rope(const T* x, int64_t x_stride, const T* cos, const T* sin, int64_t tokens,
          int64_t heads, int64_t dim, T* out) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const T* c = cos + t * dim;
        const T* s = sin + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const T* xh = x + t * x_stride + h * dim;
            T* o = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                store(o, i, load(xh, i) * load(c, i) + load(xh, i + half) * load(s, i));
                store(o, i + half,
                      load(xh, i + half) * load(c, i + half) + load(xh, i) * load(s, i + half));
            }
        }
    }
}

}  // namespace

extern "C" {
#pragma GCC visibility push(default)  // the entry points; all else hidden

void rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* weight, int64_t rows,
                   int64_t width, float eps, uint16_t* out) {
    rms_norm(x, x_stride, weight, rows, width, eps, out);
}
void rms_norm_f32(const float* x, int64_t x_stride, const float* weight, int64_t rows,
                  int64_t width, float eps, float* out) {
    rms_norm(x, x_stride, weight, rows, width, eps, out);
}
void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out) {
    silu_mul(gate_up, rows, inter, out);
}
void silu_mul_f32(const float* gate_up, int64_t rows, int64_t inter, float* out) {
    silu_mul(gate_up, rows, inter, out);
}
void rope_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* cos, const uint16_t* sin,
               int64_t tokens, int64_t heads, int64_t dim, uint16_t* out) {
    rope(x, x_stride, cos, sin, tokens, heads, dim, out);
}
void rope_f32(const float* x, int64_t x_stride, const float* cos, const float* sin,
              int64_t tokens, int64_t heads, int64_t dim, float* out) {
    rope(x, x_stride, cos, sin, tokens, heads, dim, out);
}

#pragma GCC visibility pop
}  // extern "C"
