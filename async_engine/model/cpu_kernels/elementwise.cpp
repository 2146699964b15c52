// The bf16 elementwise parts of a decoder layer, each one pass over memory instead of the
// several torch runs on CPU (F.rms_norm alone decomposes into five ops there): float32 math
// inside, one rounding to bf16 at the end. Rows are split over OpenMP threads.
#include "bf16.h"

namespace {
using namespace kernels;

// x * sigmoid(x) without overflow: exp only ever sees a non-positive argument.
inline float silu(float x) {
    const float e = fast_exp(x < 0.0f ? x : -x);
    const float sig = x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
    return x * sig;
}

}  // namespace

extern "C" {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; x rows `x_stride` elements apart.
void rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* weight, int64_t rows,
                   int64_t width, float eps, uint16_t* out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* xr = x + r * x_stride;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < width; ++i) {
            const float v = load(xr, i);
            ss += v * v;
        }
        const float scale = 1.0f / std::sqrt(ss / static_cast<float>(width) + eps);
        uint16_t* o = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) store(o, i, load(xr, i) * scale * load(weight, i));
    }
}

// out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:].
void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* g = gate_up + r * 2 * inter;
        uint16_t* o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) store(o, i, silu(load(g, i)) * load(g, inter + i));
    }
}

// Rotate-half RoPE on `heads` heads of each token: out = x * cos + roll(x, D/2) * sin, where
// sin is sign-folded ([-sin, sin]) like the model's. x rows (tokens) are `x_stride` apart;
// cos and sin are [tokens, D]; out is [tokens, heads, D].
void rope_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* cos, const uint16_t* sin,
               int64_t tokens, int64_t heads, int64_t dim, uint16_t* out) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t* c = cos + t * dim;
        const uint16_t* s = sin + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const uint16_t* xh = x + t * x_stride + h * dim;
            uint16_t* o = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                store(o, i, load(xh, i) * load(c, i) + load(xh, i + half) * load(s, i));
                store(o, i + half,
                      load(xh, i + half) * load(c, i + half) + load(xh, i) * load(s, i + half));
            }
        }
    }
}

}  // extern "C"
