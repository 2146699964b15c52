// Causal attention for prefill chunks over the paged KV cache, for the CPU device: the bf16
// kernel for AVX512-BF16 here, the AMX one in paged_prefill_amx.cpp, the float32 vector one
// (AVX2, AVX-512) in paged_prefill_vec.cpp.
//
// A flash-attention loop: each task takes up to 32 query tokens of one sequence and the G
// query heads of one KV head (so 32 G query rows share every K/V tile it builds), walks the
// keys in tiles of 32 up to its last query's position, and keeps a running max, sum and
// float32 output per row (online softmax). Both products use _mm512_dpbf16_ps with keys on
// the vector lanes, so no dot product needs a horizontal sum:
//   scores[16 keys] += K^T[dim pair] * q[dim pair]  (K tile transposed once per task tile)
//   out[16 dims]    += V[key pair]   * p[key pair]  (V tile key-interleaved once)
// The step's own K/V were written to the cache before the call, so a chunk after a cached
// prefix and a fresh prompt take the same path.
//
// Layouts: q and out [T, H, D] (the step's packed tokens); caches [blocks, block_size, KV, D];
// block_tables [S, max_blocks]; per sequence its first token's row in q (q_starts), its
// query count (q_lens) and its context length after this step (ctx_lens).
#include <vector>

#include "bf16.h"
#include "kernels.h"
#include "prefill_tiles.h"

namespace {
using namespace kernels;

#if defined(KERNELS_BF16_FAST)
constexpr int TILE = KEY_TILE;  // keys per tile: two vectors of 16 lanes
constexpr int QTILE = 32;  // query tokens per task: each K/V tile built serves 32 G rows

// exp over 16 lanes (x <= 0), the scalar fast_exp's polynomial in vector form.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

inline __m512bh kt_vec(const uint32_t* p) { return (__m512bh)_mm512_load_si512(p); }
inline __m512bh q_pair(uint32_t pair) {
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// Keys k0 .. k0 + KEY_TILE of KV head kvh, nk of them real (the rest repeat the last real
// row; the caller masks them): kt[j][i] holds dim pair j of key i (K^T), vp[k][d] the pair
// (key 2k, key 2k + 1) at dim d.
template <int D>
void pack_key_tile(const uint16_t* k_cache, const uint16_t* v_cache,
                          const PrefillSeq& seq, int kvh, int kv_heads, int block_size,
                          int64_t k0, int nk, uint32_t (*kt)[KEY_TILE], uint32_t (*vp)[D]) {
    for (int i = 0; i < KEY_TILE; ++i) {
        const int64_t at = seq.key_at(k0 + (i < nk ? i : nk - 1), kvh, kv_heads, D, block_size);
        const uint32_t* krow = reinterpret_cast<const uint32_t*>(k_cache + at);
        for (int j = 0; j < D / 2; ++j) kt[j][i] = krow[j];
        const uint16_t* vrow = v_cache + at;
        uint16_t* dst = reinterpret_cast<uint16_t*>(vp[i / 2]) + (i % 2);
        for (int d = 0; d < D; ++d) dst[2 * d] = vrow[d];
    }
}

template <int DV>
void prefill_task(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                  const PrefillSeq& seq, int kvh, int64_t t0, int heads, int kv_heads,
                  int block_size, float scale, uint16_t* out) {
    constexpr int D = 16 * DV;
    constexpr int RB = DV <= 4 ? 4 : 2;  // rows interleaved: their accumulators fit registers
    const int group = heads / kv_heads;
    const int64_t tokens = seq.q_len - t0 < QTILE ? seq.q_len - t0 : QTILE;
    const int64_t first_pos = seq.ctx - seq.q_len + t0;  // absolute position of token t0
    const int rows = static_cast<int>(tokens) * group;   // row r: token r / group, head r % group

    std::vector<float> acc(static_cast<size_t>(rows) * D, 0.0f);
    std::vector<float> top(rows, -INFINITY), sum(rows, 0.0f);
    alignas(64) uint32_t kt[D / 2][TILE];      // K^T: dim pair j of key i at kt[j][i]
    alignas(64) uint32_t vp[TILE / 2][D];      // V key pairs: (key 2k, 2k+1) at dim d
    const int64_t last_key = first_pos + tokens - 1;

    for (int64_t k0 = 0; k0 <= last_key; k0 += TILE) {
        const int nk = static_cast<int>(last_key + 1 - k0 < TILE ? last_key + 1 - k0 : TILE);
        pack_key_tile<D>(k_cache, v_cache, seq, kvh, kv_heads, block_size, k0, nk, kt, vp);
        // RB rows at a time, their steps interleaved: one row alone is a chain of dependent
        // instructions (dot products, max, exp, sum, then the P.V products) that leaves the
        // core waiting on latency; RB independent chains fill it.
        for (int r0 = 0; r0 < rows; r0 += RB) {
            const uint32_t* qrow[RB];
            __mmask16 valid[RB][2];  // keys 0-15 and 16-31 of the tile
            int pairs = 0;
            bool any = false;
            for (int i = 0; i < RB; ++i) {
                const int r = r0 + i < rows ? r0 + i : r0;  // past the end: a masked copy
                const int64_t t = r / group;  // rows run token-major: r = t * group + g
                const int h = kvh * group + (r - static_cast<int>(t) * group);
                const int64_t pos = first_pos + t;
                int visible = static_cast<int>(pos - k0 + 1 < nk ? pos - k0 + 1 : nk);
                if (r0 + i >= rows || pos < k0) visible = 0;  // nothing here for this row
                const uint32_t bits = visible >= 32 ? 0xffffffffu : (1u << visible) - 1;
                valid[i][0] = static_cast<__mmask16>(bits);
                valid[i][1] = static_cast<__mmask16>(bits >> 16);
                pairs = (visible + 1) / 2 > pairs ? (visible + 1) / 2 : pairs;
                any = any || visible > 0;
                qrow[i] =
                    reinterpret_cast<const uint32_t*>(q + ((seq.q_start + t0 + t) * heads + h) * D);
            }
            if (!any) continue;
            // Scores of RB rows against 32 keys: per dim pair, two K^T vectors serve RB rows.
            __m512 s[RB][2];
            for (int i = 0; i < RB; ++i) s[i][0] = s[i][1] = _mm512_setzero_ps();
            for (int j = 0; j < D / 2; ++j) {
                const __m512bh lo = kt_vec(kt[j]), hi = kt_vec(kt[j] + 16);
                for (int i = 0; i < RB; ++i) {
                    const __m512bh qj = q_pair(qrow[i][j]);
                    s[i][0] = _mm512_dpbf16_ps(s[i][0], lo, qj);
                    s[i][1] = _mm512_dpbf16_ps(s[i][1], hi, qj);
                }
            }
            alignas(64) uint32_t ppair[RB][TILE / 2];  // each row's probabilities, bf16 pairs
            float alpha[RB];
            for (int i = 0; i < RB; ++i) {
                const int r = r0 + i;
                if (!(valid[i][0] | valid[i][1])) {
                    alpha[i] = 1.0f;
                    for (int kp = 0; kp < TILE / 2; ++kp) ppair[i][kp] = 0;
                    continue;
                }
                const __m512 neg = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
                const __m512 a = _mm512_mask_mov_ps(neg, valid[i][0], _mm512_mul_ps(s[i][0], sc));
                const __m512 b = _mm512_mask_mov_ps(neg, valid[i][1], _mm512_mul_ps(s[i][1], sc));
                const float m_new = std::fmax(top[r], _mm512_reduce_max_ps(_mm512_max_ps(a, b)));
                const __m512 m = _mm512_set1_ps(m_new);
                const __m512 pa = _mm512_maskz_mov_ps(valid[i][0], exp16(_mm512_sub_ps(a, m)));
                const __m512 pb = _mm512_maskz_mov_ps(valid[i][1], exp16(_mm512_sub_ps(b, m)));
                alpha[i] = top[r] == -INFINITY ? 0.0f : fast_exp(top[r] - m_new);
                sum[r] = sum[r] * alpha[i] + _mm512_reduce_add_ps(_mm512_add_ps(pa, pb));
                top[r] = m_new;
                _mm512_store_si512(ppair[i], (__m512i)_mm512_cvtne2ps_pbh(pb, pa));
            }
            __m512 o[RB][DV];
            for (int i = 0; i < RB; ++i) {
                const int r = r0 + i < rows ? r0 + i : r0;
                const float* ar = acc.data() + static_cast<int64_t>(r) * D;
                for (int c = 0; c < DV; ++c) {
                    o[i][c] = _mm512_mul_ps(_mm512_loadu_ps(ar + 16 * c), _mm512_set1_ps(alpha[i]));
                }
            }
            for (int kp = 0; kp < pairs; ++kp) {
                __m512bh pp[RB];
                for (int i = 0; i < RB; ++i) pp[i] = q_pair(ppair[i][kp]);
                for (int c = 0; c < DV; ++c) {
                    const __m512bh v = kt_vec(&vp[kp][16 * c]);
                    for (int i = 0; i < RB; ++i) o[i][c] = _mm512_dpbf16_ps(o[i][c], v, pp[i]);
                }
            }
            for (int i = 0; i < RB && r0 + i < rows; ++i) {
                if (!(valid[i][0] | valid[i][1])) continue;
                float* ar = acc.data() + static_cast<int64_t>(r0 + i) * D;
                for (int c = 0; c < DV; ++c) _mm512_storeu_ps(ar + 16 * c, o[i][c]);
            }
        }
    }
    write_rows<D>(acc.data(), sum.data(), rows, seq, t0, kvh, group, heads, out);
}
#endif

// The bf16 dot-product kernel over every chunk, for head_dim 64 or 128.
bool prefill_bf16_fast(const uint16_t* q, const Paged& cache, const Chunks& chunks, int heads,
                       float scale, uint16_t* out) {
#if defined(KERNELS_BF16_FAST)
    const int head_dim = cache.head_dim;
    if (head_dim != 64 && head_dim != 128) return false;
    const PrefillTasks work = prefill_tasks(cache, chunks, QTILE);
    const auto* k_cache = static_cast<const uint16_t*>(cache.k_cache);
    const auto* v_cache = static_cast<const uint16_t*>(cache.v_cache);
    const int64_t n = static_cast<int64_t>(work.tasks.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
        const PrefillTask& task = work.tasks[i];
        const PrefillSeq& seq = work.seqs[task.seq];
        if (head_dim == 64) {
            prefill_task<4>(q, k_cache, v_cache, seq, task.kvh, task.t0, heads, cache.kv_heads,
                            cache.block_size, scale, out);
        } else {
            prefill_task<8>(q, k_cache, v_cache, seq, task.kvh, task.t0, heads, cache.kv_heads,
                            cache.block_size, scale, out);
        }
    }
    return true;
#else
    (void)q, (void)cache, (void)chunks, (void)heads, (void)scale, (void)out;
    return false;
#endif
}

}  // namespace

extern "C" {
#pragma GCC visibility push(default)  // the entry points; all else hidden

// 1 where paged_prefill runs for these dtype codes (kernels.h) and head_dim, else 0.
int paged_prefill_supported(int q_type, int kv_type, int head_dim) {
    const auto qt = static_cast<DType>(q_type), kt = static_cast<DType>(kv_type);
#if defined(KERNELS_BF16_FAST)
    if (qt == BF16 && kt == BF16 && (head_dim == 64 || head_dim == 128)) return 1;
#endif
    return vec_supported(qt, kt, head_dim);
}

// Causal prefill attention; the caller checked paged_prefill_supported. AMX tiles where they
// apply, then the bf16 dot products of AVX512-BF16, else the float32 vector kernels.
void paged_prefill(int q_type, int kv_type, const void* q, const void* k_cache,
                   const void* v_cache, const int64_t* block_tables, int64_t max_blocks,
                   const int64_t* q_starts, const int64_t* q_lens, const int64_t* ctx_lens,
                   int num_seqs, int heads, int kv_heads, int head_dim, int block_size,
                   float scale, void* out) {
    const auto qt = static_cast<DType>(q_type), kt = static_cast<DType>(kv_type);
    const Paged cache{k_cache, v_cache, block_tables, max_blocks, kv_heads, head_dim, block_size};
    const Chunks chunks{q_starts, q_lens, ctx_lens, num_seqs};
    if (qt == BF16 && kt == BF16 &&
        prefill_amx(static_cast<const uint16_t*>(q), cache, chunks, heads, scale,
                    static_cast<uint16_t*>(out))) {
        return;
    }
    if (qt == BF16 && kt == BF16 &&
        prefill_bf16_fast(static_cast<const uint16_t*>(q), cache, chunks, heads, scale,
                          static_cast<uint16_t*>(out))) {
        return;
    }
    prefill_vec(qt, kt, q, cache, chunks, heads, scale, out);
}

#pragma GCC visibility pop
}  // extern "C"
