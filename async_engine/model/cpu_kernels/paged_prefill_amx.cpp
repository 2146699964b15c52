// Causal prefill attention on AMX tiles: bf16 queries over a bf16 cache, head_dim 64 or 128.
//
// Tasks as in the AVX512-BF16 kernel (paged_prefill.cpp), with more tokens each: 128 query
// tokens of one sequence with the G query heads of one KV head (rows token-major,
// r = t * G + g), over keys in tiles of 32 up to the last token's position. Everything runs
// transposed, a query row per vector lane, so that the softmax never reduces across a
// vector. Per 16 rows and key tile:
//   scores:  S^T[32 keys][16 rows] = K Q^T: the keys' rows as the cache holds them are the
//            first operand, the rows' queries (packed once per task) the second;
//   softmax: down S^T's columns, running max and sum a lane a row, weights 2^(s c - max c)
//            (the scale and log2 e folded into c); away from the diagonal every row sees
//            every key and nothing is masked; the weights P^T, bf16, in key pairs;
//   values:  O^T[D][16 rows] += V^T P^T, the output kept transposed ([D][16] per 16 rows)
//            in memory and rescaled there, by vectors, only where a row's max grew.
// V^T is made once per key tile for the task's rows (16 x 16 transposes of dim pairs).
// Against the first AMX version (rows per tile row, a horizontal softmax, V packed in
// pairs by scalar moves): 1.8x at 8000 tokens on a 2-core Xeon.
#include <algorithm>
#include <vector>

#include "amx.h"
#include "prefill_tiles.h"
#include "vec.h"

namespace kernels {

#if defined(KERNELS_AMX)
namespace {

constexpr int KEYS = KEY_TILE;
constexpr int QTOK = 128;  // query tokens per task (256 or 512 measured no faster)
constexpr int ROWS = TILE_ROWS;

// Lane l of the result: bf16 pair (a[l], b[l]) as one 32-bit lane, a in the low half: a row
// of the pair layout the tile unit's second operand takes, from two rows of weights.
inline __m512i pair_rows(__m512bh ab) {
    // cvtne2ps_pbh(b, a) holds a's 16 bf16 then b's; interleave them.
    const __m512i order = _mm512_setr_epi32(
        0 | 16 << 16, 1 | 17 << 16, 2 | 18 << 16, 3 | 19 << 16, 4 | 20 << 16, 5 | 21 << 16,
        6 | 22 << 16, 7 | 23 << 16, 8 | 24 << 16, 9 | 25 << 16, 10 | 26 << 16, 11 | 27 << 16,
        12 | 28 << 16, 13 | 29 << 16, 14 | 30 << 16, 15 | 31 << 16);
    return _mm512_permutexvar_epi16(order, (__m512i)ab);
}

// 2^t for t <= 0, accurate to ~4e-5 relative: ample for weights rounded to bf16 (2^-9).
// Degree-4 Taylor polynomial of 2^f on f in [-1/2, 1/2]; scalef adds the integer part.
inline vf exp2_weight(vf t) {
    const vf n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = vsub(t, n);
    vf p = vset1(9.6181291e-3f);
    p = vfma(p, f, vset1(5.5504109e-2f));
    p = vfma(p, f, vset1(2.4022651e-1f));
    p = vfma(p, f, vset1(6.9314718e-1f));
    p = vfma(p, f, vset1(1.0f));
    return _mm512_scalef_ps(p, n);
}

// r[j] becomes column j of the 16 x 16 matrix of 32-bit elements whose rows r held.
inline void transpose_16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // r[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3.
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; ++i) {
        for (int k = 0; k < 4; ++k) {
            t[8 * i + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
            t[8 * i + 4 + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
        }
    }
    for (int k = 0; k < 8; ++k) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    }
}

// Keys k0 .. k0 + 31 of KV head kvh, nk of them real: k rows as they are ([32][D], the
// score product's first operand), V transposed ([D][32], the value product's first
// operand). Keys past nk are 0.
template <int D>
void load_keys(const uint16_t* k_cache, const uint16_t* v_cache, const PrefillSeq& seq,
               int kvh, int kv_heads, int block_size, int64_t k0, int nk, uint16_t (*k)[D],
               uint16_t (*vt)[KEYS]) {
    const uint16_t* vrow[KEYS];
    for (int i = 0; i < KEYS; ++i) {
        if (i >= nk) {
            std::fill(k[i], k[i] + D, uint16_t{0});
            vrow[i] = nullptr;
            continue;
        }
        const int64_t at = seq.key_at(k0 + i, kvh, kv_heads, D, block_size);
        std::copy(k_cache + at, k_cache + at + D, k[i]);
        vrow[i] = v_cache + at;
    }
    // V^T: per 32 dims, the two 16-key halves' 32-bit dim pairs transposed, then each
    // pair's low and high halves gathered into the rows of its two dims.
    const __m512i even = _mm512_setr_epi32(
        0 | 2 << 16, 4 | 6 << 16, 8 | 10 << 16, 12 | 14 << 16, 16 | 18 << 16, 20 | 22 << 16,
        24 | 26 << 16, 28 | 30 << 16, 32 | 34 << 16, 36 | 38 << 16, 40 | 42 << 16,
        44 | 46 << 16, 48 | 50 << 16, 52 | 54 << 16, 56 | 58 << 16, 60 | 62 << 16);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    for (int c = 0; c < D; c += 32) {
        __m512i half[2][16];
        for (int h = 0; h < 2; ++h) {
            for (int i = 0; i < 16; ++i) {
                const uint16_t* row = vrow[16 * h + i];
                half[h][i] = row ? _mm512_loadu_si512(row + c) : _mm512_setzero_si512();
            }
            transpose_16x16(half[h]);
        }
        for (int j = 0; j < 16; ++j) {
            const __m512i lo = half[0][j], hi = half[1][j];
            _mm512_store_si512(vt[c + 2 * j], _mm512_permutex2var_epi16(lo, even, hi));
            _mm512_store_si512(vt[c + 2 * j + 1], _mm512_permutex2var_epi16(lo, odd, hi));
        }
    }
}

// One task: query tokens t0 .. t0 + 127 of one sequence, the query heads of KV head kvh, over
// its keys, 32 at a time, each key tile through every 16-row tile that sees it. (Running the
// three stages a tile apart, so that the tile unit's products could overlap the softmax,
// measured no faster.) Per 16 rows it keeps the queries packed for the score product, the
// output transposed ([D][16], a row per lane), and the running max and sum, a lane a row.
template <int D>
class Task {
  public:
    Task(const uint16_t* q, const PrefillSeq& seq, int kvh, int64_t t0, int64_t tokens,
         int heads, int group, float scale)
        : rows_(static_cast<int>(tokens) * group),
          tiles_((rows_ + ROWS - 1) / ROWS),
          q_pairs_(static_cast<size_t>(tiles_) * DQ * ROWS * 32, 0),
          acc_(static_cast<size_t>(tiles_) * D * ROWS, 0.0f),
          top_(static_cast<size_t>(tiles_) * ROWS, -INFINITY),
          sum_(top_.size(), 0.0f),
          pos_(top_.size(), -1),
          c_(vset1(scale * 1.44269504088896341f)),
          neg_c_(vset1(-scale * 1.44269504088896341f)) {
        const int64_t first_pos = seq.ctx - seq.q_len + t0;
        for (int r = 0; r < rows_; ++r) {
            const int64_t t = r / group;
            const int h = kvh * group + r % group;
            const uint16_t* src = q + ((seq.q_start + t0 + t) * heads + h) * D;
            uint16_t* tile = q_pairs_.data() + static_cast<size_t>(r / ROWS) * DQ * ROWS * 32;
            for (int d = 0; d < D; ++d) {
                tile[(d / 32) * ROWS * 32 + ((d % 32) / 2) * 32 + (r % ROWS) * 2 + d % 2] = src[d];
            }
            pos_[r] = static_cast<int32_t>(first_pos + t);
        }
    }

    void run(const uint16_t* k_cache, const uint16_t* v_cache, const PrefillSeq& seq, int kvh,
             int kv_heads, int block_size, int64_t last_key) {
        for (int64_t k0 = 0; k0 <= last_key; k0 += KEYS) {
            const int nk = static_cast<int>(last_key + 1 - k0 < KEYS ? last_key + 1 - k0 : KEYS);
            load_keys<D>(k_cache, v_cache, seq, kvh, kv_heads, block_size, k0, nk, k_, vt_);
            // Rows run token-major, so the tiles that see any of these keys are a suffix.
            int first = 0;
            while (pos_[std::min((first + 1) * ROWS, rows_) - 1] < k0) ++first;
            for (int t = first; t < tiles_; ++t) {
                scores(t);
                softmax(t, k0);
                values(t);
            }
        }
    }

    // The rows, divided by their sums, into out [T, H, D] (write_rows wants them row-major).
    void write(const PrefillSeq& seq, int64_t t0, int kvh, int group, int heads,
               uint16_t* out) const {
        std::vector<float> rows(static_cast<size_t>(tiles_) * ROWS * D);
        for (int tile = 0; tile < tiles_; ++tile) {
            const float* acc = acc_.data() + static_cast<size_t>(tile) * D * ROWS;
            float* dst = rows.data() + static_cast<size_t>(tile) * ROWS * D;
            for (int d = 0; d < D; ++d)
                for (int l = 0; l < ROWS; ++l) dst[l * D + d] = acc[d * ROWS + l];
        }
        write_rows<D>(rows.data(), sum_.data(), rows_, seq, t0, kvh, group, heads, out);
    }

  private:
    static constexpr int DQ = D / 32;

    // S^T[32 keys][16 rows] = K Q^T into s_.
    void scores(int tile) {
        const uint16_t* qp = q_pairs_.data() + static_cast<size_t>(tile) * DQ * ROWS * 32;
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < DQ; ++c) {
            _tile_loadd(2, qp + c * ROWS * 32, 64);
            _tile_loadd(3, &k_[0][32 * c], D * 2);
            _tile_dpbf16ps(0, 3, 2);
            _tile_loadd(3, &k_[16][32 * c], D * 2);
            _tile_dpbf16ps(1, 3, 2);
        }
        _tile_stored(0, &s_[0][0], 64);
        _tile_stored(1, &s_[16][0], 64);
    }

    // Down S^T's columns, a query row per lane, in raw scores (the scale goes into the
    // exponent): away from the diagonal every row sees all 32 keys; on it each key is
    // masked to the rows at or after its position. The weights go to p_ in key pairs;
    // where a row's max grew, its sum and output are rescaled here.
    void softmax(int tile, int64_t k0) {
        const vf neg = vset1(-INFINITY);
        float* top = top_.data() + tile * ROWS;
        float* sum = sum_.data() + tile * ROWS;
        const bool all_seen = k0 + KEYS - 1 <= pos_[tile * ROWS];
        const __m512i pos = _mm512_loadu_si512(pos_.data() + tile * ROWS);
        __mmask16 seen[KEYS];
        vf x[KEYS];
        const vf old_top = vload(top);
        vf m = old_top;
        for (int i = 0; i < KEYS; ++i) {
            x[i] = vload(s_[i]);
            if (!all_seen) {
                seen[i] = _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(k0 + i)),
                                                pos, _MM_CMPINT_LE);
                x[i] = _mm512_mask_mov_ps(neg, seen[i], x[i]);
            }
            m = vmax(m, x[i]);
        }
        // Lanes that have seen no key yet keep -inf; their weights are masked to 0.
        const __mmask16 live = _mm512_cmp_ps_mask(m, neg, _CMP_NEQ_OQ);
        const vf shift = vmul(_mm512_maskz_mov_ps(live, m), neg_c_);
        vf total = vzero();
        for (int i = 0; i < KEYS; i += 2) {
            vf a = exp2_weight(vfma(x[i], c_, shift));
            vf b = exp2_weight(vfma(x[i + 1], c_, shift));
            if (!all_seen) {
                a = _mm512_maskz_mov_ps(seen[i], a);
                b = _mm512_maskz_mov_ps(seen[i + 1], b);
            }
            const __m512bh w = _mm512_cvtne2ps_pbh(b, a);
            _mm512_store_si512(p_[i / 2], pair_rows(w));
            // The weights as rounded, so that they sum to the divisor.
            const __m512i bits = (__m512i)w;
            total = vadd(total, _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(bits)));
            total = vadd(total, _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(bits, 1)));
        }
        const __mmask16 grew = _mm512_cmp_ps_mask(m, old_top, _CMP_NEQ_OQ) & live;
        const __mmask16 had = _mm512_cmp_ps_mask(old_top, neg, _CMP_NEQ_OQ);
        // alpha = 2^((old max - new max) c) where the max grew (0 where nothing was seen
        // before: its sum and output are 0), 1 elsewhere.
        const vf alpha = _mm512_mask_mov_ps(
            vset1(1.0f), grew, _mm512_maskz_mov_ps(had, exp2_weight(vfma(old_top, c_, shift))));
        vstore(sum, vfma(vload(sum), alpha, total));
        vstore(top, m);
        if (grew) {
            float* acc = acc_.data() + static_cast<size_t>(tile) * D * ROWS;
            for (int d = 0; d < D; ++d) {
                vstore(acc + d * ROWS, vmul(vload(acc + d * ROWS), alpha));
            }
        }
    }

    // O^T[D][16] += V^T P^T, the accumulators loaded from and stored back to the output.
    void values(int tile) {
        float* acc = acc_.data() + static_cast<size_t>(tile) * D * ROWS;
        _tile_loadd(2, &p_[0][0], 64);
        for (int d0 = 0; d0 < D; d0 += 64) {
            float* a = acc + d0 * ROWS;
            _tile_loadd(4, a, 64);
            _tile_loadd(5, a + 16 * ROWS, 64);
            _tile_loadd(6, a + 32 * ROWS, 64);
            _tile_loadd(7, a + 48 * ROWS, 64);
            _tile_loadd(3, &vt_[d0][0], KEYS * 2);
            _tile_dpbf16ps(4, 3, 2);
            _tile_loadd(3, &vt_[d0 + 16][0], KEYS * 2);
            _tile_dpbf16ps(5, 3, 2);
            _tile_loadd(3, &vt_[d0 + 32][0], KEYS * 2);
            _tile_dpbf16ps(6, 3, 2);
            _tile_loadd(3, &vt_[d0 + 48][0], KEYS * 2);
            _tile_dpbf16ps(7, 3, 2);
            _tile_stored(4, a, 64);
            _tile_stored(5, a + 16 * ROWS, 64);
            _tile_stored(6, a + 32 * ROWS, 64);
            _tile_stored(7, a + 48 * ROWS, 64);
        }
    }

    int rows_, tiles_;
    std::vector<uint16_t> q_pairs_;  // [tile][c][16 dim pairs][16 rows x 2]
    std::vector<float> acc_;         // [tile][D][16]
    std::vector<float> top_, sum_;   // [tile][16]
    std::vector<int32_t> pos_;       // [tile][16]: each row's position, -1 past the rows
    vf c_, neg_c_;  // weights are 2^(s c - max c): the scale and log2(e) in one factor
    alignas(64) uint16_t k_[KEYS][D];
    alignas(64) uint16_t vt_[D][KEYS];
    alignas(64) float s_[KEYS][ROWS];        // S^T: a key per row, a query row per lane
    alignas(64) uint32_t p_[KEYS / 2][ROWS];  // P^T in key pairs: the value product's B
};

template <int D>
void prefill_task(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                  const PrefillSeq& seq, int kvh, int64_t t0, int heads, int kv_heads,
                  int block_size, float scale, uint16_t* out) {
    const int group = heads / kv_heads;
    const int64_t tokens = seq.q_len - t0 < QTOK ? seq.q_len - t0 : QTOK;
    Task<D> task(q, seq, kvh, t0, tokens, heads, group, scale);
    task.run(k_cache, v_cache, seq, kvh, kv_heads, block_size,
             seq.ctx - seq.q_len + t0 + tokens - 1);
    task.write(seq, t0, kvh, group, heads, out);
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
