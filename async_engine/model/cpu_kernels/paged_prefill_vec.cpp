// Causal prefill attention in float32 vectors (AVX2+FMA: 8 lanes, AVX-512: 16) over the
// paged KV cache in place, for float32 models and for bf16 or fp16 caches widened as loaded.
//
// The flash-attention loop of paged_prefill.cpp without bf16 dot products: each task takes
// up to QTILE query tokens of one sequence and the G query heads of one KV head, walks the
// keys in tiles of KTILE (two vectors), widens each tile once (K transposed, keys on the
// lanes, so a score needs no horizontal sum) and keeps a running max, sum and float32
// output per row. RB rows interleave: one row alone is a chain of dependent instructions.
#include <type_traits>
#include <vector>

#include "vec.h"

namespace kernels {

#if defined(KERNELS_VEC)
namespace {

constexpr int KTILE = 2 * W;  // keys per tile: two vectors
constexpr int QTILE = 32;     // query tokens per task: each tile built serves 32 G rows
constexpr int RB = 4;         // rows interleaved
constexpr int S = NREG == 32 ? 4 : 2;  // vectors of D per P.V register tile (RB * S)

struct Task {
    int seq, kvh;
    int64_t t0;  // first query token of the task within its chunk
};

struct TaskView {  // what a task reads: its rows of q, its sequence's block table
    int64_t first_row, first_pos, tokens;  // q row and position of token t0; tokens in the task
    const int64_t* table;
    int kvh, group, heads;
};

// The tile's keys [k0, k0 + nk) of KV head view.kvh, widened: kt[d][i] = K[i][d], v[i][d].
template <typename C>
void load_tile(const Paged& cache, const TaskView& view, int64_t k0, int nk, float* kt, float* v) {
    const int D = cache.head_dim;
    const int64_t row_width = static_cast<int64_t>(cache.kv_heads) * D;
    const int64_t block_stride = row_width * cache.block_size;
    for (int i = 0; i < KTILE; ++i) {
        if (i >= nk) {  // padding: zeros, so masked keys carry no NaN into the sums
            for (int d = 0; d < D; ++d) kt[d * KTILE + i] = v[i * D + d] = 0.0f;
            continue;
        }
        const int64_t key = k0 + i, head_at = static_cast<int64_t>(view.kvh) * D;
        const int64_t at = view.table[key / cache.block_size] * block_stride +
                           (key % cache.block_size) * row_width + head_at;
        const C* krow = static_cast<const C*>(cache.k_cache) + at;
        const C* vrow = static_cast<const C*>(cache.v_cache) + at;
        for (int d = 0; d < D; ++d) kt[d * KTILE + i] = load(krow, d);
        for (int d = 0; d < D; d += W) vstore(v + i * D + d, vload(vrow + d));
    }
}

struct RowState {  // the online softmax of a task's rows: running max, sum, output
    std::vector<float> top, sum, acc;
};

// Rows r0 .. r0 + RB against one key tile: scores, online softmax, then P.V into acc.
void rows_step(const float* qf, int rows, int r0, const int* visible, const float* kt,
               const float* v, int D, RowState& st) {
    vf s[RB][2];
    for (int i = 0; i < RB; ++i) s[i][0] = s[i][1] = vzero();
    const float* qr[RB];
    for (int i = 0; i < RB; ++i) qr[i] = qf + static_cast<int64_t>(r0 + i < rows ? r0 + i : r0) * D;
    for (int d = 0; d < D; ++d) {
        const vf lo = vload(kt + d * KTILE), hi = vload(kt + d * KTILE + W);
        for (int i = 0; i < RB; ++i) {
            const vf qd = vset1(qr[i][d]);
            s[i][0] = vfma(lo, qd, s[i][0]);
            s[i][1] = vfma(hi, qd, s[i][1]);
        }
    }
    alignas(64) float p[RB][KTILE];
    float alpha[RB];
    int keys = 0;  // keys any of the rows sees
    for (int i = 0; i < RB; ++i) {
        const int n = visible[i], r = r0 + i;
        keys = n > keys ? n : keys;
        alpha[i] = 1.0f;
        if (n == 0) {
            for (int k = 0; k < KTILE; ++k) p[i][k] = 0.0f;
            continue;
        }
        const int na = n < W ? n : W, nb = n > W ? n - W : 0;
        const vf a = keep_first(s[i][0], na, -INFINITY), b = keep_first(s[i][1], nb, -INFINITY);
        const float m_new = std::fmax(st.top[r], hmax(vmax(a, b)));
        const vf m = vset1(m_new);
        const vf pa = keep_first(vexp(vsub(a, m)), na, 0.0f);
        const vf pb = keep_first(vexp(vsub(b, m)), nb, 0.0f);
        alpha[i] = st.top[r] == -INFINITY ? 0.0f : fast_exp(st.top[r] - m_new);
        st.sum[r] = st.sum[r] * alpha[i] + hsum(vadd(pa, pb));
        st.top[r] = m_new;
        vstore(p[i], pa);
        vstore(p[i] + W, pb);
    }
    for (int c0 = 0; c0 < D; c0 += S * W) {
        const int sc = (D - c0) / W < S ? (D - c0) / W : S;
        vf o[RB][S];
        for (int i = 0; i < RB; ++i) {
            const float* ar = st.acc.data() + static_cast<int64_t>(r0 + i < rows ? r0 + i : r0) * D;
            for (int s2 = 0; s2 < S; ++s2) {
                o[i][s2] = s2 < sc ? vmul(vload(ar + c0 + s2 * W), vset1(alpha[i])) : vzero();
            }
        }
        for (int k = 0; k < keys; ++k) {
            vf vv[S];
            const float* vk = v + k * D + c0;
            for (int s2 = 0; s2 < S; ++s2) vv[s2] = s2 < sc ? vload(vk + s2 * W) : vzero();
            for (int i = 0; i < RB; ++i) {
                const vf pk = vset1(p[i][k]);
                for (int s2 = 0; s2 < S; ++s2) o[i][s2] = vfma(pk, vv[s2], o[i][s2]);
            }
        }
        for (int i = 0; i < RB && r0 + i < rows; ++i) {
            float* ar = st.acc.data() + static_cast<int64_t>(r0 + i) * D;
            for (int s2 = 0; s2 < sc; ++s2) vstore(ar + c0 + s2 * W, o[i][s2]);
        }
    }
}

template <typename T, typename C>
void prefill_task(const T* q, const Paged& cache, const TaskView& view, float scale, T* out) {
    const int D = cache.head_dim, group = view.group;
    const int rows = static_cast<int>(view.tokens) * group;  // row r: token r / G, head r % G
    std::vector<float> qf(static_cast<size_t>(rows) * D);
    auto row_at = [&](int r) {  // element offset of row r in q and out
        const int64_t h = static_cast<int64_t>(view.kvh) * group + r % group;
        return ((view.first_row + r / group) * view.heads + h) * D;
    };
    for (int r = 0; r < rows; ++r) {
        float* qr = qf.data() + static_cast<size_t>(r) * D;
        for (int d = 0; d < D; ++d) qr[d] = load(q, row_at(r) + d) * scale;
    }
    RowState st{std::vector<float>(rows, -INFINITY), std::vector<float>(rows, 0.0f),
                std::vector<float>(static_cast<size_t>(rows) * D, 0.0f)};
    std::vector<float> kt(static_cast<size_t>(D) * KTILE), v(kt.size());
    const int64_t last_key = view.first_pos + view.tokens - 1;
    for (int64_t k0 = 0; k0 <= last_key; k0 += KTILE) {
        const int nk = static_cast<int>(last_key + 1 - k0 < KTILE ? last_key + 1 - k0 : KTILE);
        load_tile<C>(cache, view, k0, nk, kt.data(), v.data());
        for (int r0 = 0; r0 < rows; r0 += RB) {
            int visible[RB];  // keys of this tile each row sees (causal), 0 past the rows
            int any = 0;
            for (int i = 0; i < RB; ++i) {
                const int64_t pos = view.first_pos + (r0 + i) / group;
                const int64_t n = pos - k0 + 1 < nk ? pos - k0 + 1 : nk;
                visible[i] = r0 + i < rows && n > 0 ? static_cast<int>(n) : 0;
                any |= visible[i];
            }
            if (any) rows_step(qf.data(), rows, r0, visible, kt.data(), v.data(), D, st);
        }
    }
    for (int r = 0; r < rows; ++r) {
        const float inv = 1.0f / st.sum[r];
        const float* ar = st.acc.data() + static_cast<size_t>(r) * D;
        for (int d = 0; d < D; ++d) store(out, row_at(r) + d, ar[d] * inv);
    }
}

template <typename T, typename C>
void prefill_batch(const T* q, const Paged& cache, const Chunks& chunks, int heads, float scale,
                   T* out) {
    std::vector<Task> tasks;
    for (int s = 0; s < chunks.num_seqs; ++s) {
        // Longest first (the last tokens see the most keys), so the threads finish together.
        for (int64_t t0 = (chunks.q_lens[s] - 1) / QTILE * QTILE; t0 >= 0; t0 -= QTILE)
            for (int kvh = 0; kvh < cache.kv_heads; ++kvh) tasks.push_back({s, kvh, t0});
    }
    const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
        const Task& task = tasks[i];
        const int64_t q_len = chunks.q_lens[task.seq];
        const TaskView view{chunks.q_starts[task.seq] + task.t0,
                            chunks.ctx_lens[task.seq] - q_len + task.t0,
                            q_len - task.t0 < QTILE ? q_len - task.t0 : QTILE,
                            cache.block_tables + task.seq * cache.max_blocks,
                            task.kvh,
                            heads / cache.kv_heads,
                            heads};
        prefill_task<T, C>(q, cache, view, scale, out);
    }
}

}  // namespace
#endif

bool prefill_vec(DType qt, DType kt, const void* q, const Paged& cache, const Chunks& chunks,
                 int heads, float scale, void* out) {
#if defined(KERNELS_VEC)
    if (!vec_supported(qt, kt, cache.head_dim)) return false;
    return with_types(qt, kt, [&](auto* t, auto* c) {
        using T = std::remove_pointer_t<decltype(t)>;
        using C = std::remove_pointer_t<decltype(c)>;
        prefill_batch<T, C>(static_cast<const T*>(q), cache, chunks, heads, scale,
                            static_cast<T*>(out));
        return true;
    });
#else
    (void)qt, (void)kt, (void)q, (void)cache, (void)chunks, (void)heads, (void)scale, (void)out;
    return false;
#endif
}

}  // namespace kernels
