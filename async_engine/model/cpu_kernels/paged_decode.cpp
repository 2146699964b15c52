// Decode attention that reads the paged KV cache in place (no gather), for the CPU device.
//
// One query token per sequence; scores and the softmax in float32 whatever the cache dtype.
// Four implementations, the first that applies runs (see paged_decode at the end): AMX
// tiles (paged_decode_amx.cpp), bf16 dot products on AVX512-BF16 (here), float32 vectors on
// AVX2 or AVX-512 with bf16 or fp16 caches widened in registers (paged_decode_vec.cpp), and
// generic loops (here) that the compiler vectorises as it can, for other CPUs and head sizes.
// The generic loops split work over sequences with OpenMP; each K/V position's row (every KV
// head, contiguous in the cache) is loaded once for all heads.
//
// Layouts (contiguous, row-major):
//   q            [B, H, D]
//   k/v cache    [num_blocks, block_size, KV, D]
//   block_tables [B, max_blocks] int64
//   context_lens [B] int64  (tokens to attend to, this step's included)
//   out          [B, H, D]
#include <vector>

#include "bf16.h"
#include "kernels.h"

namespace {
using namespace kernels;

// Each of `rows` rows of `n` scores becomes exp(score - max), unnormalised; inv_sums[r]
// gets 1 / its sum (the caller scales its weighted sum once instead of every weight).
inline void softmax_rows(float* scores, int64_t n, int rows, float* inv_sums) {
    for (int r = 0; r < rows; ++r) {
        float* row = scores + r * n;
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < n; ++i) top = row[i] > top ? row[i] : top;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
            row[i] = fast_exp(row[i] - top);
            sum += row[i];
        }
        inv_sums[r] = 1.0f / sum;
    }
}

// q . k over head_dim floats. The generic loop leaves its reduction to the compiler, which
// sums the vector lanes one by one through the stack; the AVX-512 one reduces in registers.
inline float dot(const float* a, const float* b, int n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (int i = 16; i < n; i += 16) {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        }
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

template <typename T>
void paged_decode_generic(const T* q, const T* k_cache, const T* v_cache,
                          const int64_t* block_tables, int64_t max_blocks,
                          const int64_t* context_lens, int batch, int heads, int kv_heads,
                          int head_dim, int block_size, float scale, T* out) {
    const int group = heads / kv_heads;
    const int row_width = kv_heads * head_dim;  // one KV position, every KV head: contiguous
    const int64_t block_stride = static_cast<int64_t>(row_width) * block_size;
    // One task per sequence: each K/V row is read once, whole, for all its heads.
#pragma omp parallel for schedule(dynamic, 1)
    for (int b = 0; b < batch; ++b) {
        const int64_t ctx = context_lens[b];
        const int64_t* table = block_tables + b * max_blocks;
        std::vector<float> qf(static_cast<size_t>(heads) * head_dim);
        std::vector<float> scores(static_cast<size_t>(heads) * ctx);
        std::vector<float> acc(static_cast<size_t>(heads) * head_dim, 0.0f);
        std::vector<float> row(row_width);
        std::vector<float> inv_sums(heads);
        std::vector<int> kv_offset(heads);  // where head h's KV head starts within a row
        for (int h = 0; h < heads; ++h) kv_offset[h] = (h / group) * head_dim;
        const int64_t q_base = static_cast<int64_t>(b) * heads * head_dim;
        for (int i = 0; i < heads * head_dim; ++i) qf[i] = load(q, q_base + i) * scale;

        // Walk the blocks with counters: a division per position costs more than its dots.
        for (int64_t pos = 0, block = 0; pos < ctx; pos += block_size, ++block) {
            const T* rows = k_cache + table[block] * block_stride;
            const int64_t n = ctx - pos < block_size ? ctx - pos : block_size;
            for (int64_t j = 0; j < n; ++j) {
                for (int i = 0; i < row_width; ++i) row[i] = load(rows, j * row_width + i);
                for (int h = 0; h < heads; ++h) {
                    scores[h * ctx + pos + j] =
                        dot(qf.data() + h * head_dim, row.data() + kv_offset[h], head_dim);
                }
            }
        }
        softmax_rows(scores.data(), ctx, heads, inv_sums.data());
        for (int64_t pos = 0, block = 0; pos < ctx; pos += block_size, ++block) {
            const T* rows = v_cache + table[block] * block_stride;
            const int64_t n = ctx - pos < block_size ? ctx - pos : block_size;
            for (int64_t j = 0; j < n; ++j) {
                for (int i = 0; i < row_width; ++i) row[i] = load(rows, j * row_width + i);
                for (int h = 0; h < heads; ++h) {
                    const float p = scores[h * ctx + pos + j];
                    const float* vh = row.data() + kv_offset[h];
                    float* ah = acc.data() + h * head_dim;
#pragma omp simd
                    for (int d = 0; d < head_dim; ++d) ah[d] += p * vh[d];
                }
            }
        }
        for (int h = 0; h < heads; ++h) {
            for (int d = 0; d < head_dim; ++d) {
                store(out, q_base + h * head_dim + d, acc[h * head_dim + d] * inv_sums[h]);
            }
        }
    }
}

#if defined(KERNELS_BF16_FAST)
// The bf16 path for head_dim = 16 * DV, on CPUs with AVX512-BF16 (most time goes here).
//
// q . k: _mm512_dpbf16_ps multiplies bf16 pairs into float32 sums, 32 products an
// instruction, with no conversion of K. The 16 lanes of each dot product are then summed
// 16 positions at a time by a transpose-and-add tree (about 3 instructions a dot instead of
// the 8 of a lone horizontal sum), which lands the 16 scores in one register, in order.
// p . v: each V row is converted once and added into the float32 accumulators of every
// head that reads it, held in registers (HC heads at a time).

template <int DV>
void decode_one_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                     const int64_t* offsets, int64_t ctx, int heads, int kv_heads, float scale,
                     float* scores, float* acc_mem, uint16_t* out) {
    constexpr int D = 16 * DV;
    constexpr int HC = DV <= 4 ? 4 : 2;  // heads whose accumulators share the registers
    const int group = heads / kv_heads;
    const int64_t row_bytes = static_cast<int64_t>(kv_heads) * D * 2;
    // Chunks of 16 positions outermost: a chunk's rows come from memory once and serve every
    // head from L1 (the cache is read from DRAM, so the loop order sets the speed).
    prefetch_chunk<_MM_HINT_T0>(k_cache, offsets, 0, ctx, row_bytes);
    prefetch_chunk<_MM_HINT_T0>(k_cache, offsets, 16, ctx, row_bytes);
    for (int64_t p0 = 0; p0 < ctx; p0 += 16) {
        const int n = ctx - p0 < 16 ? static_cast<int>(ctx - p0) : 16;
        prefetch_chunk<_MM_HINT_T0>(k_cache, offsets, p0 + 32, ctx, row_bytes);
        prefetch_chunk<_MM_HINT_T1>(v_cache, offsets, p0, ctx, row_bytes);  // for the V pass
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
        for (int h = 0; h < heads; ++h) {
            const int64_t kv_at = static_cast<int64_t>(h / group) * D;
            __m512bh qh[DV / 2];
            for (int c = 0; c < DV / 2; ++c) qh[c] = load_bf16x32(q + h * D + 32 * c);
            __m512 acc[16];
            for (int i = 0; i < 16; ++i) {
                acc[i] = _mm512_setzero_ps();
                if (i >= n) continue;
                const uint16_t* k = k_cache + offsets[p0 + i] + kv_at;
                for (int c = 0; c < DV / 2; ++c) {
                    acc[i] = _mm512_dpbf16_ps(acc[i], qh[c], load_bf16x32(k + 32 * c));
                }
            }
            const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + h * ctx + p0, valid, s);
        }
    }
    std::vector<float> inv_sums(heads);
    softmax_rows(scores, ctx, heads, inv_sums.data());
    for (int i = 0; i < heads * D; ++i) acc_mem[i] = 0.0f;
    for (int64_t p0 = 0; p0 < ctx; p0 += 16) {
        const int n = ctx - p0 < 16 ? static_cast<int>(ctx - p0) : 16;
        prefetch_chunk<_MM_HINT_T0>(v_cache, offsets, p0 + 32, ctx, row_bytes);
        for (int kvh = 0; kvh < kv_heads; ++kvh) {
            for (int g0 = 0; g0 < group; g0 += HC) {
                const int h0 = kvh * group + g0;
                const int hc = group - g0 < HC ? group - g0 : HC;
                __m512 acc[HC][DV];
                for (int i = 0; i < HC; ++i) {
                    for (int c = 0; c < DV; ++c) {
                        acc[i][c] = i < hc ? _mm512_loadu_ps(acc_mem + (h0 + i) * D + 16 * c)
                                           : _mm512_setzero_ps();
                    }
                }
                for (int j = 0; j < n; ++j) {
                    const uint16_t* v = v_cache + offsets[p0 + j] + static_cast<int64_t>(kvh) * D;
                    __m512 vf[DV];
                    for (int c = 0; c < DV; ++c) vf[c] = load_bf16x16(v + 16 * c);
                    for (int i = 0; i < HC; ++i) {
                        if (i >= hc) break;
                        const __m512 p = _mm512_set1_ps(scores[(h0 + i) * ctx + p0 + j]);
                        for (int c = 0; c < DV; ++c) {
                            acc[i][c] = _mm512_fmadd_ps(p, vf[c], acc[i][c]);
                        }
                    }
                }
                for (int i = 0; i < hc; ++i) {
                    for (int c = 0; c < DV; ++c) {
                        _mm512_storeu_ps(acc_mem + (h0 + i) * D + 16 * c, acc[i][c]);
                    }
                }
            }
        }
    }
    for (int h = 0; h < heads; ++h) {
        const __m512 inv = _mm512_set1_ps(inv_sums[h]);
        for (int c = 0; c < DV; ++c) {
            const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(acc_mem + h * D + 16 * c), inv);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h * D + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(r));
        }
    }
}

// Returns false where the fast path does not apply (the caller runs the generic one).
bool paged_decode_fast(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int64_t* block_tables, int64_t max_blocks,
                       const int64_t* context_lens, int batch, int heads, int kv_heads,
                       int head_dim, int block_size, float scale, uint16_t* out) {
    if (head_dim != 64 && head_dim != 128) return false;
    const int64_t row_width = static_cast<int64_t>(kv_heads) * head_dim;
    const int64_t block_stride = row_width * block_size;
#pragma omp parallel for schedule(dynamic, 1)
    for (int b = 0; b < batch; ++b) {
        const int64_t ctx = context_lens[b];
        const int64_t* table = block_tables + b * max_blocks;
        // Where each position's K/V row starts, walked with counters (no division).
        std::vector<int64_t> offsets(ctx);
        for (int64_t pos = 0, block = 0; pos < ctx; pos += block_size, ++block) {
            const int64_t n = ctx - pos < block_size ? ctx - pos : block_size;
            const int64_t base = table[block] * block_stride;
            for (int64_t j = 0; j < n; ++j) offsets[pos + j] = base + j * row_width;
        }
        std::vector<float> scores(static_cast<size_t>(heads) * ctx);
        std::vector<float> acc(static_cast<size_t>(heads) * head_dim);
        const int64_t at = static_cast<int64_t>(b) * heads * head_dim;
        if (head_dim == 64) {
            decode_one_bf16<4>(q + at, k_cache, v_cache, offsets.data(), ctx, heads, kv_heads,
                               scale, scores.data(), acc.data(), out + at);
        } else {
            decode_one_bf16<8>(q + at, k_cache, v_cache, offsets.data(), ctx, heads, kv_heads,
                               scale, scores.data(), acc.data(), out + at);
        }
    }
    return true;
}
#else
bool paged_decode_fast(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*,
                       int64_t, const int64_t*, int, int, int, int, int, float, uint16_t*) {
    return false;
}
#endif

enum class DecodeKernel { None, Amx, Bf16, Vector, Generic };

// The one place that decides which implementation runs: paged_decode dispatches on it and
// paged_decode_kernel names it.
DecodeKernel choose_decode(DType qt, DType kt, int heads, int kv_heads, int head_dim,
                           int block_size) {
    const bool generic = qt == kt && (qt == F32 || qt == BF16);  // any head_dim
    if (!generic && !vec_supported(qt, kt, head_dim)) return DecodeKernel::None;
    if (qt == BF16 && kt == BF16) {
        if (amx_applies(heads, kv_heads, head_dim, block_size)) return DecodeKernel::Amx;
#if defined(KERNELS_BF16_FAST)
        if (head_dim == 64 || head_dim == 128) return DecodeKernel::Bf16;
#endif
    }
    return vec_supported(qt, kt, head_dim) ? DecodeKernel::Vector : DecodeKernel::Generic;
}

}  // namespace

extern "C" {
#pragma GCC visibility push(default)  // the entry points; all else hidden

// 1 where paged_decode runs for these dtype codes (kernels.h) and head_dim, else 0.
int paged_decode_supported(int q_type, int kv_type, int head_dim) {
    // The shape arguments only pick among kernels that all run: any will do here.
    const auto qt = static_cast<DType>(q_type), kt = static_cast<DType>(kv_type);
    return choose_decode(qt, kt, 1, 1, head_dim, 1) != DecodeKernel::None;
}

// Which implementation paged_decode runs for these arguments: "amx", "avx512-bf16",
// "vector", "generic" or "none" (unsupported).
const char* paged_decode_kernel(int q_type, int kv_type, int heads, int kv_heads, int head_dim,
                                int block_size) {
    switch (choose_decode(static_cast<DType>(q_type), static_cast<DType>(kv_type), heads,
                          kv_heads, head_dim, block_size)) {
        case DecodeKernel::Amx:
            return "amx";
        case DecodeKernel::Bf16:
            return "avx512-bf16";
        case DecodeKernel::Vector:
            return "vector";
        case DecodeKernel::Generic:
            return "generic";
        default:
            return "none";
    }
}

// Decode attention; the caller checked paged_decode_supported. AMX tiles first, the bf16
// dot products of AVX512-BF16 next, then the float32 vector kernels, then the generic loops.
void paged_decode(int q_type, int kv_type, const void* q, const void* k_cache,
                  const void* v_cache, const int64_t* block_tables, int64_t max_blocks,
                  const int64_t* context_lens, int batch, int heads, int kv_heads, int head_dim,
                  int block_size, float scale, void* out) {
    const auto qt = static_cast<DType>(q_type), kt = static_cast<DType>(kv_type);
    using u16 = uint16_t;
    const auto* qb = static_cast<const u16*>(q);
    const auto* kb = static_cast<const u16*>(k_cache);
    const auto* vb = static_cast<const u16*>(v_cache);
    const Paged cache{k_cache, v_cache, block_tables, max_blocks, kv_heads, head_dim, block_size};
    switch (choose_decode(qt, kt, heads, kv_heads, head_dim, block_size)) {
        case DecodeKernel::Amx:
            decode_amx(qb, kb, vb, block_tables, max_blocks, context_lens, batch, heads, kv_heads,
                       head_dim, block_size, scale, static_cast<u16*>(out));
            return;
        case DecodeKernel::Bf16:
            paged_decode_fast(qb, kb, vb, block_tables, max_blocks, context_lens, batch, heads,
                              kv_heads, head_dim, block_size, scale, static_cast<u16*>(out));
            return;
        case DecodeKernel::Vector:
            decode_vec(qt, kt, q, cache, context_lens, batch, heads, scale, out);
            return;
        case DecodeKernel::Generic:
            if (qt == F32) {
                paged_decode_generic(static_cast<const float*>(q),
                                     static_cast<const float*>(k_cache),
                                     static_cast<const float*>(v_cache), block_tables, max_blocks,
                                     context_lens, batch, heads, kv_heads, head_dim, block_size,
                                     scale, static_cast<float*>(out));
            } else {
                paged_decode_generic(qb, kb, vb, block_tables, max_blocks, context_lens, batch,
                                     heads, kv_heads, head_dim, block_size, scale,
                                     static_cast<u16*>(out));
            }
            return;
        case DecodeKernel::None:
            return;
    }
}

#pragma GCC visibility pop
}  // extern "C"
