// Decode attention in float32 vectors (AVX2+FMA: 8 lanes, AVX-512: 16) over the paged KV
// cache in place, for float32 models and for caches in bf16 or fp16, widened in registers.
//
// One task per (sequence, KV head, part of PART positions of its context): the task's G
// query heads share every K/V row slice it loads, and a batch of one still spreads over the
// threads; the parts' results are merged at the end, as flash-decoding merges them. A
// sequence may bring several query tokens (a verify step's row: paged_spans), their G rows
// each sharing the loads too, each token masked to its causal share. Parts start at fixed
// positions, so a row's result depends on nothing but its own query and context: not on the
// batch beside it, and a verify row's token gets exactly what decoding it alone would. Two
// passes over a task's part:
//   scores: W positions at a time, each head's W dot products summed across lanes together
//           (sum_lanes), landing the W scores in one vector, in order;
//   values: the probabilities times V, HC heads by S vectors of D held in registers while
//           a chunk of V rows streams past.
// Rows are prefetched PREFETCH positions ahead: the cache comes from DRAM, and the hardware
// prefetcher does not follow a block table.
#include <algorithm>
#include <cmath>
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
constexpr int64_t PART = 512;          // positions a task takes: parts start at multiples of it

struct Rows {  // one task's view: where each position's row starts, and its KV head's slice
    const int64_t* offsets;
    int64_t ctx, at;
    int head_dim;
};

// Exponentiates a row of n >= 1 scores in place, less their max (unnormalised); returns
// their sum, the max in `top`.
inline float softmax_row(float* s, int64_t n, float& top_out) {
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
    top_out = m;
    return total;
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

struct Span {  // one sequence's query tokens: the first's row in q, how many, its context after
    int64_t first, tokens, ctx;
    const int64_t* table;
};

struct Task {  // positions [lo, hi) of a span's context, for the query heads of one KV head
    int64_t span, lo, hi;
    int kvh, part;  // part: of the span's parts, the index (0: the one whose rows it stores)
};

// Row r of a KV head's G * tokens rows (token r / G, head kvh * G + r % G): its element
// offset in q and out from the span's first token.
inline int64_t row_at(int r, int group, int kvh, int heads, int head_dim) {
    return ((r / group) * static_cast<int64_t>(heads) + kvh * group + r % group) * head_dim;
}

// The G query heads of KV head `kvh` for a span's `tokens` query tokens (the last of its
// context, causal: token t sees all but the last tokens - 1 - t positions) over positions
// [lo, hi), every K/V row loaded once for all G * tokens rows. q points at the span's first
// token's [H, D] rows. Per row r: the scores' max in top[r], the sum of their exponentials in
// sum[r] and those times V in acc[r * D ..] (0 and -inf where the row sees none of them).
// (`span` by value: taken by reference, the kernel measured 20-25 % slower with g++ -O3.)
template <typename T, typename C>
void attend_part(const T* q, const Paged& cache, const int64_t* offsets, const Task& task,
                 const Span span, int heads, float scale, float* top, float* sum, float* acc) {
    const int D = cache.head_dim, group = heads / cache.kv_heads;
    const int n = static_cast<int>(span.tokens) * group;
    const Rows rows{offsets + task.lo, task.hi - task.lo, static_cast<int64_t>(task.kvh) * D, D};
    const int64_t stride = (rows.ctx + W - 1) / W * W;  // score rows padded to whole vectors
    std::vector<float> qf(static_cast<size_t>(n) * D), scores(static_cast<size_t>(n) * stride);
    for (int r = 0; r < n; ++r) {
        const int64_t at = row_at(r, group, task.kvh, heads, D);
        for (int d = 0; d < D; ++d) qf[static_cast<size_t>(r) * D + d] = load(q, at + d) * scale;
    }
    const C* k_cache = static_cast<const C*>(cache.k_cache);
    const C* v_cache = static_cast<const C*>(cache.v_cache);
    score_pass(qf.data(), n, k_cache, v_cache, rows, scores.data(), stride);
    for (int r = 0; r < n; ++r) {
        float* s = scores.data() + r * stride;
        const int64_t seen = span.ctx - (span.tokens - 1 - r / group) - task.lo;  // in this part
        const int64_t kept = seen < rows.ctx ? (seen > 0 ? seen : 0) : rows.ctx;
        top[r] = -INFINITY, sum[r] = 0.0f;
        if (kept > 0) sum[r] = softmax_row(s, kept, top[r]);
        for (int64_t j = kept; j < rows.ctx; ++j) s[j] = 0.0f;  // the value pass reads them all
    }
    std::fill(acc, acc + static_cast<size_t>(n) * D, 0.0f);
    value_pass(scores.data(), n, stride, v_cache, rows, acc);
}

// Row r's parts (max, sum, weighted V at part p's `at[p]`) merged into its output.
template <typename T>
void merge_row(const float* top, const float* sum, const float* acc, const int64_t* at,
               int64_t parts, int r, int D, float* merged, T* out) {
    float m = -INFINITY;
    for (int64_t p = 0; p < parts; ++p) m = std::fmax(m, top[at[p] + r]);
    float total = 0.0f;
    std::fill(merged, merged + D, 0.0f);
    for (int64_t p = 0; p < parts; ++p) {
        if (sum[at[p] + r] == 0.0f) continue;  // the row sees none of that part
        const float w = fast_exp(top[at[p] + r] - m);
        total += w * sum[at[p] + r];
        const float* a = acc + (at[p] + r) * D;
        for (int d = 0; d < D; ++d) merged[d] += w * a[d];
    }
    for (int d = 0; d < D; ++d) store(out, d, merged[d] / total);
}

// Each span's query rows attended: a task per (span, KV head, part), then each row's parts
// merged.
template <typename T, typename C, typename SpanAt>
void attend_spans(const T* q, const Paged& cache, int64_t count, SpanAt span_at, int heads,
                  float scale, T* out) {
    if (count == 0) return;
    const int kv_heads = cache.kv_heads, block_size = cache.block_size, D = cache.head_dim;
    const int group = heads / kv_heads;
    const int64_t row_width = static_cast<int64_t>(kv_heads) * D;
    const int64_t block_stride = row_width * block_size;
    std::vector<Task> tasks;  // a span's, by KV head, then by part
    std::vector<int64_t> parts(count);
    for (int64_t i = 0; i < count; ++i) {
        const int64_t ctx = span_at(i).ctx;
        parts[i] = (ctx + PART - 1) / PART;
        for (int kvh = 0; kvh < kv_heads; ++kvh) {
            for (int64_t p = 0; p < parts[i]; ++p) {
                const int64_t lo = p * PART, hi = std::min(lo + PART, ctx);
                tasks.push_back({i, lo, hi, kvh, static_cast<int>(p)});
            }
        }
    }
    // Where each task's rows keep their max, sum and weighted V.
    std::vector<int64_t> at(tasks.size() + 1, 0);
    for (size_t t = 0; t < tasks.size(); ++t) {
        at[t + 1] = at[t] + span_at(tasks[t].span).tokens * group;
    }
    std::vector<float> top(at.back()), sum(at.back()), acc(static_cast<size_t>(at.back()) * D);
    const int64_t n_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel
    {
        std::vector<int64_t> offsets;  // walked with counters: no division per position
        std::vector<float> merged(D);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_tasks; ++t) {
            const Task& task = tasks[t];
            const Span span = span_at(task.span);
            offsets.resize(task.hi);
            for (int64_t pos = task.lo / block_size * block_size; pos < task.hi;
                 pos += block_size) {
                const int64_t n = task.hi - pos < block_size ? task.hi - pos : block_size;
                const int64_t base = span.table[pos / block_size] * block_stride;
                for (int64_t j = 0; j < n; ++j) offsets[pos + j] = base + j * row_width;
            }
            attend_part<T, C>(q + span.first * heads * D, cache, offsets.data(), task, span,
                              heads, scale, top.data() + at[t], sum.data() + at[t],
                              acc.data() + at[t] * D);
        }
        // Each (span, KV head) from its first part's task: the parts merged, the rows stored.
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_tasks; ++t) {
            const Task& task = tasks[t];
            if (task.part != 0) continue;
            const Span span = span_at(task.span);
            T* o = out + span.first * heads * D;
            for (int r = 0; r < static_cast<int>(span.tokens) * group; ++r) {
                merge_row(top.data(), sum.data(), acc.data(), at.data() + t, parts[task.span], r,
                          D, merged.data(), o + row_at(r, group, task.kvh, heads, D));
            }
        }
    }
}

}  // namespace
#endif

bool spans_vec(DType qt, DType kt, const void* q, const Paged& cache, const Chunks& chunks,
               int heads, float scale, void* out) {
#if defined(KERNELS_VEC)
    if (!vec_supported(qt, kt, cache.head_dim)) return false;
    auto span_at = [&](int64_t s) {
        return Span{chunks.q_starts[s], chunks.q_lens[s], chunks.ctx_lens[s],
                    cache.block_tables + s * cache.max_blocks};
    };
    return with_types(qt, kt, [&](auto* t, auto* c) {
        using T = std::remove_pointer_t<decltype(t)>;
        using C = std::remove_pointer_t<decltype(c)>;
        attend_spans<T, C>(static_cast<const T*>(q), cache, chunks.num_seqs, span_at, heads,
                           scale, static_cast<T*>(out));
        return true;
    });
#else
    (void)qt, (void)kt, (void)q, (void)cache, (void)chunks, (void)heads, (void)scale, (void)out;
    return false;
#endif
}

bool decode_vec(DType qt, DType kt, const void* q, const Paged& cache,
                const int64_t* context_lens, int batch, int heads, float scale, void* out) {
#if defined(KERNELS_VEC)
    if (!vec_supported(qt, kt, cache.head_dim)) return false;
    auto span_at = [&](int64_t b) {
        return Span{b, 1, context_lens[b], cache.block_tables + b * cache.max_blocks};
    };
    return with_types(qt, kt, [&](auto* t, auto* c) {
        using T = std::remove_pointer_t<decltype(t)>;
        using C = std::remove_pointer_t<decltype(c)>;
        attend_spans<T, C>(static_cast<const T*>(q), cache, batch, span_at, heads, scale,
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
// 1 where paged_spans runs for these dtype codes (kernels.h) and head_dim, else 0.
int paged_spans_supported(int q_type, int kv_type, int head_dim) {
    return kernels::vec_supported(static_cast<kernels::DType>(q_type),
                                  static_cast<kernels::DType>(kv_type), head_dim);
}

// Attention of chunks whose every token is sampled (kernels::spans_vec); the caller checked
// paged_spans_supported. Arguments as paged_prefill's.
void paged_spans(int q_type, int kv_type, const void* q, const void* k_cache, const void* v_cache,
                 const int64_t* block_tables, int64_t max_blocks, const int64_t* q_starts,
                 const int64_t* q_lens, const int64_t* ctx_lens, int num_seqs, int heads,
                 int kv_heads, int head_dim, int block_size, float scale, void* out) {
    const kernels::Paged cache{k_cache,  v_cache,  block_tables, max_blocks,
                               kv_heads, head_dim, block_size};
    const kernels::Chunks chunks{q_starts, q_lens, ctx_lens, num_seqs};
    kernels::spans_vec(static_cast<kernels::DType>(q_type), static_cast<kernels::DType>(kv_type),
                       q, cache, chunks, heads, scale, out);
}

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
