// Causal prefill attention on AMX tiles: bf16 queries over a bf16 cache, head_dim 64 or 128.
//
// The AVX512-BF16 kernel (paged_prefill.cpp) spends ~8 cycles a score, which made
// attention most of a long prompt's prefill (8000 tokens: ~14 s of ~18 on a 2-core Xeon).
// Here the tile unit does both products and the vector unit the online softmax: ~3 cycles
// a score, prefill 1.4x (1024 tokens) to 2.2x (8000) faster.
//
// Tasks as in that kernel, with more tokens each: 128 query tokens of one sequence with the
// G query heads of one KV head (rows token-major, r = t * G + g), keys in tiles of 32 up to
// the last token's position, K^T and V packed once per key tile (and task: 128 tokens
// share the packing, 32 paid for it four times) in the layouts the tile unit's second
// operand takes (pairs along the summed dimension). Per 16 rows:
//   scores: S[16][32] = Q[16][D] K^T in two accumulators (keys 0-15, 16-31);
//   softmax: per row, masked to its visible keys, running max and sum as in the other
//            kernel; the weights P, bf16, are the next product's first operand;
//   values: T[16][D] = P V in accumulators of 16 columns, then acc = acc * alpha + T.
#include <algorithm>
#include <vector>

#include "amx.h"
#include "prefill_tiles.h"
#include "vec.h"

namespace kernels {

#if defined(KERNELS_AMX)
namespace {

constexpr int KEYS = KEY_TILE;
constexpr int QTOK = 128;  // query tokens per task (32: 10 % slower at 8000 tokens)

// The four accumulators 4..7 over 64 columns of V from `vp` (column 0 there): T += P V.
inline void values_64(const uint32_t* vp, int64_t row_bytes) {
    _tile_loadd(3, vp, row_bytes);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(3, vp + 16, row_bytes);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(3, vp + 32, row_bytes);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(3, vp + 48, row_bytes);
    _tile_dpbf16ps(7, 2, 3);
}

inline void store_64(float* t, int64_t row_bytes) {
    _tile_stored(4, t, row_bytes);
    _tile_stored(5, t + 16, row_bytes);
    _tile_stored(6, t + 32, row_bytes);
    _tile_stored(7, t + 48, row_bytes);
}

template <int D>
void prefill_task(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                  const PrefillSeq& seq, int kvh, int64_t t0, int heads, int kv_heads,
                  int block_size, float scale, uint16_t* out) {
    constexpr int DQ = D / 32;
    const int group = heads / kv_heads;
    const int64_t tokens = seq.q_len - t0 < QTOK ? seq.q_len - t0 : QTOK;
    const int64_t first_pos = seq.ctx - seq.q_len + t0;  // absolute position of token t0
    const int rows = static_cast<int>(tokens) * group;
    const int tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;

    // The task's query rows, contiguous (rows past `rows` 0): the first operand of S.
    std::vector<uint16_t> qrows(static_cast<size_t>(tiles) * TILE_ROWS * D, 0);
    for (int r = 0; r < rows; ++r) {
        const int64_t t = r / group;
        const int h = kvh * group + r % group;
        const uint16_t* src = q + ((seq.q_start + t0 + t) * heads + h) * D;
        std::copy(src, src + D, qrows.data() + static_cast<size_t>(r) * D);
    }
    std::vector<float> acc(static_cast<size_t>(tiles) * TILE_ROWS * D, 0.0f);
    std::vector<float> top(static_cast<size_t>(tiles) * TILE_ROWS, -INFINITY);
    std::vector<float> sum(top.size(), 0.0f);
    alignas(64) uint32_t kt[D / 2][KEYS];    // K^T: dim pair j of key i at kt[j][i]
    alignas(64) uint32_t vp[KEYS / 2][D];    // V key pairs: (key 2k, 2k+1) at dim d
    alignas(64) float s[TILE_ROWS][KEYS];        // a tile's scores
    alignas(64) uint16_t p[TILE_ROWS][KEYS];     // its weights, bf16
    alignas(64) float t_out[TILE_ROWS][D];       // P V
    float alpha[TILE_ROWS];
    const int64_t last_key = first_pos + tokens - 1;

    for (int64_t k0 = 0; k0 <= last_key; k0 += KEYS) {
        const int nk = static_cast<int>(last_key + 1 - k0 < KEYS ? last_key + 1 - k0 : KEYS);
        pack_key_tile<D>(k_cache, v_cache, seq, kvh, kv_heads, block_size, k0, nk, kt, vp);
        for (int tile = 0; tile < tiles; ++tile) {
            const int r0 = tile * TILE_ROWS;
            // Rows run token-major, so a tile's last row sees the most keys.
            const int last_row = r0 + TILE_ROWS - 1 < rows - 1 ? r0 + TILE_ROWS - 1 : rows - 1;
            if (first_pos + last_row / group < k0) continue;
            const uint16_t* qt = qrows.data() + static_cast<size_t>(r0) * D;
            _tile_zero(0);
            _tile_zero(1);
            for (int c = 0; c < DQ; ++c) {
                _tile_loadd(2, qt + 32 * c, D * 2);
                _tile_loadd(3, &kt[16 * c][0], KEYS * 4);
                _tile_dpbf16ps(0, 2, 3);
                _tile_loadd(3, &kt[16 * c][16], KEYS * 4);
                _tile_dpbf16ps(1, 2, 3);
            }
            _tile_stored(0, &s[0][0], KEYS * 4);
            _tile_stored(1, &s[0][16], KEYS * 4);
            for (int i = 0; i < TILE_ROWS; ++i) {
                const int r = r0 + i;
                const int64_t pos = first_pos + r / group;
                int visible = static_cast<int>(pos - k0 + 1 < nk ? pos - k0 + 1 : nk);
                if (r >= rows || pos < k0) visible = 0;
                if (visible == 0) {
                    alpha[i] = 1.0f;
                    std::fill(p[i], p[i] + KEYS, uint16_t{0});
                    continue;
                }
                const uint32_t bits = visible >= 32 ? 0xffffffffu : (1u << visible) - 1;
                const __mmask16 lo_keys = static_cast<__mmask16>(bits);
                const __mmask16 hi_keys = static_cast<__mmask16>(bits >> 16);
                const vf neg = vset1(-INFINITY), sc = vset1(scale);
                const vf a = _mm512_mask_mov_ps(neg, lo_keys, vmul(vload(s[i]), sc));
                const vf b = _mm512_mask_mov_ps(neg, hi_keys, vmul(vload(s[i] + 16), sc));
                const float m_new = std::fmax(top[r], hmax(vmax(a, b)));
                const vf m = vset1(m_new);
                const vf pa = _mm512_maskz_mov_ps(lo_keys, vexp(vsub(a, m)));
                const vf pb = _mm512_maskz_mov_ps(hi_keys, vexp(vsub(b, m)));
                const __m512bh w = _mm512_cvtne2ps_pbh(pb, pa);
                _mm512_store_si512(p[i], (__m512i)w);
                alpha[i] = top[r] == -INFINITY ? 0.0f : fast_exp(top[r] - m_new);
                // The weights as rounded, so that they sum to the divisor.
                const __m512 rounded = _mm512_add_ps(
                    _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)w)),
                    _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)w, 1)));
                sum[r] = sum[r] * alpha[i] + hsum(rounded);
                top[r] = m_new;
            }
            _tile_loadd(2, &p[0][0], KEYS * 2);
            for (int c0 = 0; c0 < D; c0 += 64) {
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                values_64(&vp[0][c0], D * 4);
                store_64(&t_out[0][c0], D * 4);
            }
            for (int i = 0; i < TILE_ROWS && r0 + i < rows; ++i) {
                float* ar = acc.data() + static_cast<size_t>(r0 + i) * D;
                const vf al = vset1(alpha[i]);
                for (int d = 0; d < D; d += 16) {
                    vstore(ar + d, vfma(vload(ar + d), al, vload(t_out[i] + d)));
                }
            }
        }
    }
    write_rows<D>(acc.data(), sum.data(), rows, seq, t0, kvh, group, heads, out);
}

}  // namespace
#endif

bool prefill_amx(const uint16_t* q, const Paged& cache, const Chunks& chunks, int heads,
                 float scale, uint16_t* out) {
#if defined(KERNELS_AMX)
    const int head_dim = cache.head_dim;
    if ((head_dim != 64 && head_dim != 128) || !tiles_permitted()) return false;
    const PrefillTasks work = prefill_tasks(cache, chunks, QTOK);
    const auto* k_cache = static_cast<const uint16_t*>(cache.k_cache);
    const auto* v_cache = static_cast<const uint16_t*>(cache.v_cache);
    const int64_t n = static_cast<int64_t>(work.tasks.size());
#pragma omp parallel
    {
        configure_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) {
            const PrefillTask& task = work.tasks[i];
            const PrefillSeq& seq = work.seqs[task.seq];
            if (head_dim == 64) {
                prefill_task<64>(q, k_cache, v_cache, seq, task.kvh, task.t0, heads,
                                 cache.kv_heads, cache.block_size, scale, out);
            } else {
                prefill_task<128>(q, k_cache, v_cache, seq, task.kvh, task.t0, heads,
                                  cache.kv_heads, cache.block_size, scale, out);
            }
        }
        _tile_release();
    }
    return true;
#else
    (void)q, (void)cache, (void)chunks, (void)heads, (void)scale, (void)out;
    return false;
#endif
}

}  // namespace kernels
