// Decode attention in float32 vectors (AVX2+FMA: 8 lanes, AVX-512: 16) over the paged KV
// cache in place, for float32 models and for caches in bf16 or fp16, widened in registers.
//
// One task per (sequence, KV head): the task's G query heads share every K/V row slice it
// loads, and a batch of one still spreads over the threads. Two passes over the context:
//   scores: W positions at a time, each head's W dot products summed across lanes together
//           (sum_lanes), landing the W scores in one vector, in order;
//   values: the probabilities times V, HC heads by S vectors of D held in registers while
//           a chunk of V rows streams past.
// Rows are prefetched PREFETCH positions ahead: the cache comes from DRAM, and the hardware
// prefetcher does not follow a block table.
#include <type_traits>
#include <vector>

#include "vec.h"

namespace kernels {

bool vec_supported(DType qt, DType kt, int head_dim) {
#if defined(KERNELS_VEC)
    const bool types = qt == kt || qt == F32;
    return types && head_dim > 0 && head_dim % W == 0;
#else
    (void)qt, (void)kt, (void)head_dim;
    return false;
#endif
}

#if defined(KERNELS_VEC)
namespace {

constexpr int64_t PREFETCH = 32;  // positions ahead: ~2 us of DRAM latency at decode speed
constexpr int CHUNK = 32;         // V rows per values-pass chunk: they stay in L1 for all heads
constexpr int HC = 4;             // heads per register tile in the values pass
constexpr int S = NREG == 32 ? 4 : 2;  // vectors of D per register tile (HC * S accumulators)

struct Rows {  // one task's view: where each position's row starts, and its KV head's slice
    const int64_t* offsets;
    int64_t ctx, at;
    int head_dim;
};

// Exponentiates a row of n scores in place (unnormalised); returns 1 / their sum.
inline float softmax_row(float* s, int64_t n) {
    vf top = vset1(-INFINITY);
    int64_t i = 0;
    for (; i + W <= n; i += W) top = vmax(top, vload(s + i));
    float m = hmax(top);
    for (; i < n; ++i) m = s[i] > m ? s[i] : m;
    const vf mv = vset1(m);
    vf sum = vzero();
    for (i = 0; i + W <= n; i += W) {
        const vf e = vexp(vsub(vload(s + i), mv));
        vstore(s + i, e);
        sum = vadd(sum, e);
    }
    float total = hsum(sum);
    for (; i < n; ++i) total += s[i] = fast_exp(s[i] - m);
    return 1.0f / total;
}

// scores[g][pos] = qf[g] . K[pos] for the task's G heads (qf pre-scaled).
template <typename C>
void score_pass(const float* qf, int group, const C* k_cache, const C* v_cache, const Rows& r,
                float* scores, int64_t stride) {
    const int D = r.head_dim;
    const int64_t bytes = D * static_cast<int64_t>(sizeof(C));
    const int64_t ctx = r.ctx;
    prefetch_rows<_MM_HINT_T0>(k_cache, r.offsets, 0, ctx < PREFETCH ? ctx : PREFETCH, r.at, bytes);
    for (int64_t p0 = 0; p0 < ctx; p0 += W) {
        const int64_t ahead = p0 + PREFETCH, end = p0 + W < ctx ? p0 + W : ctx;
        if (ahead < ctx) {
            prefetch_rows<_MM_HINT_T0>(k_cache, r.offsets, ahead, ahead + W < ctx ? ahead + W : ctx,
                                       r.at, bytes);
        }
        prefetch_rows<_MM_HINT_T1>(v_cache, r.offsets, p0, end, r.at, bytes);  // for the V pass
        const C* k[W];  // past the context: the last row again, its lanes land in the padding
        for (int i = 0; i < W; ++i) {
            k[i] = k_cache + r.offsets[p0 + i < ctx ? p0 + i : ctx - 1] + r.at;
        }
        for (int g = 0; g < group; ++g) {
            vf a[W];
            for (int i = 0; i < W; ++i) a[i] = vzero();
            for (int c = 0; c < D; c += W) {
                const vf qv = vload(qf + g * D + c);
                for (int i = 0; i < W; ++i) a[i] = vfma(qv, vload(k[i] + c), a[i]);
            }
            vstore(scores + g * stride + p0, sum_lanes(a));
        }
    }
}

// acc[g] += sum over positions of p[g][pos] * V[pos], heads g0 .. g0 + hc, dims c0 .. + sc W.
template <typename C>
inline void value_tile(const float* p, int64_t stride, const C* v_cache, const Rows& r, int64_t p0,
                       int64_t end, int hc, int c0, int sc, float* acc) {
    const int D = r.head_dim;
    vf o[HC][S];
    for (int i = 0; i < HC; ++i) {
        for (int s = 0; s < S; ++s) {
            o[i][s] = i < hc && s < sc ? vload(acc + i * D + c0 + s * W) : vzero();
        }
    }
    for (int64_t j = p0; j < end; ++j) {
        const C* v = v_cache + r.offsets[j] + r.at + c0;
        vf vv[S];
        for (int s = 0; s < S; ++s) vv[s] = s < sc ? vload(v + s * W) : vzero();
        for (int i = 0; i < HC; ++i) {
            if (i >= hc) break;
            const vf pj = vset1(p[i * stride + j]);
            for (int s = 0; s < S; ++s) o[i][s] = vfma(pj, vv[s], o[i][s]);
        }
    }
    for (int i = 0; i < hc; ++i) {
        for (int s = 0; s < sc; ++s) vstore(acc + i * D + c0 + s * W, o[i][s]);
    }
}

template <typename C>
void value_pass(const float* p, int group, int64_t stride, const C* v_cache, const Rows& r,
                float* acc) {
    const int D = r.head_dim;
    const int64_t bytes = D * static_cast<int64_t>(sizeof(C));
    for (int64_t p0 = 0; p0 < r.ctx; p0 += CHUNK) {
        const int64_t end = p0 + CHUNK < r.ctx ? p0 + CHUNK : r.ctx;
        const int64_t next = end + CHUNK < r.ctx ? end + CHUNK : r.ctx;
        prefetch_rows<_MM_HINT_T0>(v_cache, r.offsets, end, next, r.at, bytes);
        for (int g0 = 0; g0 < group; g0 += HC) {
            const int hc = group - g0 < HC ? group - g0 : HC;
            for (int c0 = 0; c0 < D; c0 += S * W) {
                const int sc = (D - c0) / W < S ? (D - c0) / W : S;
                value_tile(p + g0 * stride, stride, v_cache, r, p0, end, hc, c0, sc, acc + g0 * D);
            }
        }
    }
}

// The G query heads of KV head `kvh` of one sequence; q and out point at its [H, D] rows.
template <typename T, typename C>
void decode_group(const T* q, const Paged& cache, const Rows& rows, int kvh, int group,
                  float scale, T* out) {
    const int D = cache.head_dim;
    const int64_t stride = (rows.ctx + W - 1) / W * W;  // score rows padded to whole vectors
    std::vector<float> qf(static_cast<size_t>(group) * D), acc(qf.size(), 0.0f);
    std::vector<float> scores(static_cast<size_t>(group) * stride), inv(group);
    const int64_t first = static_cast<int64_t>(kvh) * group * D;  // head kvh * G's first value
    for (size_t i = 0; i < qf.size(); ++i) qf[i] = load(q, first + i) * scale;
    const C* k_cache = static_cast<const C*>(cache.k_cache);
    const C* v_cache = static_cast<const C*>(cache.v_cache);
    score_pass(qf.data(), group, k_cache, v_cache, rows, scores.data(), stride);
    for (int g = 0; g < group; ++g) inv[g] = softmax_row(scores.data() + g * stride, rows.ctx);
    value_pass(scores.data(), group, stride, v_cache, rows, acc.data());
    for (size_t i = 0; i < acc.size(); ++i) store(out, first + i, acc[i] * inv[i / D]);
}

template <typename T, typename C>
void decode_batch(const T* q, const Paged& cache, const int64_t* context_lens, int batch,
                  int heads, float scale, T* out) {
    const int kv_heads = cache.kv_heads, block_size = cache.block_size;
    const int group = heads / kv_heads;
    const int64_t row_width = static_cast<int64_t>(kv_heads) * cache.head_dim;
    const int64_t block_stride = row_width * block_size;
    const int64_t tasks = static_cast<int64_t>(batch) * kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t b = t / kv_heads;
        const int kvh = static_cast<int>(t % kv_heads);
        const int64_t ctx = context_lens[b];
        const int64_t* table = cache.block_tables + b * cache.max_blocks;
        std::vector<int64_t> offsets(ctx);  // walked with counters: no division per position
        for (int64_t pos = 0, block = 0; pos < ctx; pos += block_size, ++block) {
            const int64_t n = ctx - pos < block_size ? ctx - pos : block_size;
            const int64_t base = table[block] * block_stride;
            for (int64_t j = 0; j < n; ++j) offsets[pos + j] = base + j * row_width;
        }
        const Rows rows{offsets.data(), ctx, static_cast<int64_t>(kvh) * cache.head_dim,
                        cache.head_dim};
        const int64_t at = b * heads * cache.head_dim;
        decode_group<T, C>(q + at, cache, rows, kvh, group, scale, out + at);
    }
}

}  // namespace
#endif

bool decode_vec(DType qt, DType kt, const void* q, const Paged& cache,
                const int64_t* context_lens, int batch, int heads, float scale, void* out) {
#if defined(KERNELS_VEC)
    if (!vec_supported(qt, kt, cache.head_dim)) return false;
    return with_types(qt, kt, [&](auto* t, auto* c) {
        using T = std::remove_pointer_t<decltype(t)>;
        using C = std::remove_pointer_t<decltype(c)>;
        decode_batch<T, C>(static_cast<const T*>(q), cache, context_lens, batch, heads, scale,
                           static_cast<T*>(out));
        return true;
    });
#else
    (void)qt, (void)kt, (void)q, (void)cache, (void)context_lens, (void)batch, (void)heads;
    (void)scale, (void)out;
    return false;
#endif
}

}  // namespace kernels

extern "C" {
#pragma GCC visibility push(default)
// The instruction set the build's vector kernels use: what `bench offline` prints.
const char* kernel_isa() {
#if defined(KERNELS_BF16_FAST)
    return kernels::amx_built() ? "avx512-bf16-amx" : "avx512-bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(KERNELS_VEC)
    return "avx2";
#else
    return "generic";
#endif
}
#pragma GCC visibility pop
}  // extern "C"
