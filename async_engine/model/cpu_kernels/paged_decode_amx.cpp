// Decode attention on AMX tiles: bf16 queries over a bf16 cache, on CPUs with AMX-BF16.
//
// The AVX512-BF16 kernel (paged_decode.cpp) computes about as long as the cache takes to
// arrive from DRAM, and on the machines measured the two barely overlap, so its arithmetic
// sets half its time. Here the tile unit does the multiplications and the vector unit only
// the softmax and the reshuffling of V: 5-20 % faster decode attention on a 2-core Xeon with
// AMX (the most on long contexts), the rest being the cache's reads.
//
// Per sequence, for each tile of up to 16 query heads (whole KV groups):
//   scores:  S^T[pos][h] = K[pos] . q[h], 16 positions a tile: the cache rows are a tile's
//            rows as they lie (a block's rows are contiguous), q is the second operand,
//            packed once per sequence, one copy per KV head with the other groups' columns 0;
//   softmax: down the columns of S^T, a head per lane; the weights P (bf16) land
//            transposed, [head][pos], one copy per KV head with the other groups' rows 0;
//   values:  O[h][d] += P[h][pos] V[pos][d], 32 positions a tile: each pair of V rows is
//            interleaved into the pair layout the tile unit multiplies.
// Needs blocks of a multiple of 16 positions (a tile's rows never leave a block) and
// head_dim 64 or 128; elsewhere it declines and the AVX512-BF16 kernel runs.
#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"
#include "vec.h"

namespace kernels {

#if defined(KERNELS_AMX)
namespace {

// The intrinsics name tiles by literal number: 0-3 accumulate, 4-7 hold operands (and 1-3
// too while the score pass needs only two accumulators).
constexpr int ROWS = TILE_ROWS;
constexpr int TILE_ELEMS = ROWS * 32;  // bf16 elements in one tile

// Where position `pos` of a sequence starts in the cache (elements).
struct Positions {
    const int64_t* table;
    int64_t block_size, block_stride, row_width;
    int64_t at(int64_t pos) const {
        return table[pos / block_size] * block_stride + (pos % block_size) * row_width;
    }
};

// The 16 query heads (at most) of KV heads [kv0, kv0 + kvs) of one sequence.
struct HeadTile {
    int kv0, kvs, group;
    int heads() const { return kvs * group; }
};

// One thread's buffers for one call, sized for the batch's longest context. Only the active
// group's columns of q_tiles_ and rows of weights_ are ever written, so the other groups'
// stay 0, as the masking by KV head needs.
template <int D>
class Workspace {
  public:
    Workspace(int kv_heads, int64_t longest)
        : stride_((longest + 31) / 32 * 32),
          q_tiles_(static_cast<size_t>(kv_heads) * DQ * TILE_ELEMS, 0),
          weights_(static_cast<size_t>(kv_heads) * ROWS * stride_, 0),
          v_tiles_(2 * static_cast<size_t>(kv_heads) * DV * TILE_ELEMS),
          scores_(static_cast<size_t>(stride_) * ROWS),
          acc_(static_cast<size_t>(ROWS) * D) {}

    // out rows [heads][D] of tile `t`'s heads of one sequence; q the same heads' rows.
    void attend(const uint16_t* k, const uint16_t* v, const Positions& at, int64_t ctx,
                const uint16_t* q, const HeadTile& t, float scale, uint16_t* out) {
        k_ = k, v_ = v, at_ = at, ctx_ = ctx;
        pack_queries(q, t);
        score_pass(t);
        softmax(t, scale);
        value_pass(t);
        // pack_values's column order back to head_dim's (see there).
        const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                                22, 23);
        const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
        for (int h = 0; h < t.heads(); ++h) {
            const vf inv = vset1(inv_sums_[h]);
            for (int c = 0; c < D; c += 32) {
                const float* acc = acc_.data() + h * D + c;
                const vf lo = vload(acc), hi = vload(acc + 16);
                vstore(out + h * D + c, vmul(_mm512_permutex2var_ps(lo, first, hi), inv));
                vstore(out + h * D + c + 16, vmul(_mm512_permutex2var_ps(lo, second, hi), inv));
            }
        }
    }

  private:
    static constexpr int DQ = D / 32;  // q/K tiles across head_dim (32 bf16 each)
    static constexpr int DV = D / 16;  // V/output tiles across head_dim (16 floats each)

    // q_tiles_[j][c]: rows r hold q[h][32c + 2r .. +1] for each head h of KV head j.
    void pack_queries(const uint16_t* q, const HeadTile& t) {
        for (int h = 0; h < t.heads(); ++h) {
            uint16_t* tiles = q_tiles_.data() + static_cast<size_t>(h / t.group) * DQ * TILE_ELEMS;
            for (int d = 0; d < D; ++d) {
                tiles[(d / 32) * TILE_ELEMS + ((d % 32) / 2) * 32 + h * 2 + d % 2] = q[h * D + d];
            }
        }
    }

    const uint16_t* k_rows(int64_t pos, const HeadTile& t) const {
        return k_ + at_.at(pos) + static_cast<int64_t>(t.kv0) * D;
    }

    // Two 16-position chunks at a time, in accumulators 0 and 1: consecutive products into
    // one accumulator wait for each other.
    void score_pass(const HeadTile& t) {
        const int64_t row_bytes = at_.row_width * 2;
        for (int64_t p0 = 0; p0 < ctx_; p0 += 2 * ROWS) {
            prefetch_ahead(k_, p0 + 2 * ROWS);
            const bool two = p0 + ROWS < ctx_;
            const uint16_t* first = k_rows(p0, t);
            const uint16_t* second = two ? k_rows(p0 + ROWS, t) : first;
            _tile_zero(0);
            _tile_zero(1);
            for (int j = 0; j < t.kvs; ++j) {
                for (int c = 0; c < DQ; ++c) {
                    _tile_loadd(4, q_tiles_.data() + (j * DQ + c) * TILE_ELEMS, 64);
                    _tile_loadd(2, first + j * D + 32 * c, row_bytes);
                    _tile_dpbf16ps(0, 2, 4);
                    if (two) {
                        _tile_loadd(3, second + j * D + 32 * c, row_bytes);
                        _tile_dpbf16ps(1, 3, 4);
                    }
                }
            }
            _tile_stored(0, scores_.data() + p0 * ROWS, 64);
            if (two) _tile_stored(1, scores_.data() + (p0 + ROWS) * ROWS, 64);
        }
    }

    // The 32 positions from `from` on (two blocks' 16 rows, every KV head), where the context
    // has them, asked for ahead of use: the hardware prefetcher does not follow a block table.
    // Measured: two blocks ahead for K, four for V (packed a chunk early) is best; asking for
    // V during the score pass, or further ahead, is slower.
    void prefetch_ahead(const uint16_t* cache, int64_t from) const {
        const int64_t bytes = at_.row_width * 2 * ROWS;
        for (int64_t pos = from; pos < from + 2 * ROWS && pos < ctx_; pos += ROWS) {
            const char* p = reinterpret_cast<const char*>(cache + at_.at(pos));
            for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
        }
    }

    // scores_ [pos][16] -> weights_[j][h][pos] in bf16, unnormalised; inv_sums_[h].
    void softmax(const HeadTile& t, float scale) {
        const vf sv = vset1(scale);
        vf top = vset1(-INFINITY);
        for (int64_t p = 0; p < ctx_; ++p) top = vmax(top, vld(p, sv));
        uint16_t* rows[ROWS];
        const int64_t end = (ctx_ + 31) / 32 * 32;
        for (int h = 0; h < t.heads(); ++h) {
            rows[h] = weights_.data() + (static_cast<size_t>(h / t.group) * ROWS + h) * stride_;
            for (int64_t p = ctx_; p < end; ++p) rows[h][p] = 0;  // the last chunk's tail
        }
        vf sum = vzero();
        alignas(64) uint16_t lanes[ROWS];
        for (int64_t p = 0; p < ctx_; ++p) {
            const __m256bh w = _mm512_cvtneps_pbh(vexp(vsub(vld(p, sv), top)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), (__m256i)w);
            sum = vadd(sum, _mm512_cvtpbh_ps(w));  // the weights as rounded sum to the divisor
            for (int h = 0; h < t.heads(); ++h) rows[h][p] = lanes[h];
        }
        alignas(64) float sums[ROWS];
        vstore(sums, sum);
        for (int h = 0; h < t.heads(); ++h) inv_sums_[h] = 1.0f / sums[h];
    }

    vf vld(int64_t p, vf scale) const { return vmul(vload(scores_.data() + p * ROWS), scale); }

    // Accumulators 0..3 hold 64 output columns; a head_dim of 128 takes two rounds a chunk,
    // reloading them from acc_. The next chunk's V is packed before this one's products: a
    // tile load right after stores to its bytes waits for them (~30 cycles more).
    void value_pass(const HeadTile& t) {
        constexpr int rounds = DV / 4;
        const size_t buffer = static_cast<size_t>(t.kvs) * DV * TILE_ELEMS;
        if (rounds == 1) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        } else {
            std::fill(acc_.begin(), acc_.end(), 0.0f);
        }
        pack_values(t, 0, v_tiles_.data());
        for (int64_t p0 = 0, chunk = 0; p0 < ctx_; p0 += 2 * ROWS, ++chunk) {
            prefetch_ahead(v_, p0 + 4 * ROWS);
            const uint16_t* tiles = v_tiles_.data() + (chunk % 2) * buffer;
            if (p0 + 2 * ROWS < ctx_) {
                pack_values(t, p0 + 2 * ROWS, v_tiles_.data() + ((chunk + 1) % 2) * buffer);
            }
            for (int round = 0; round < rounds; ++round) {
                if (rounds > 1) load_accumulators(round);
                for (int j = 0; j < t.kvs; ++j) {
                    const uint16_t* w = weights_.data() + static_cast<size_t>(j) * ROWS * stride_;
                    const uint16_t* b = tiles + (j * DV + 4 * round) * TILE_ELEMS;
                    _tile_loadd(4, w + p0, stride_ * 2);
                    _tile_loadd(5, b, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, b + TILE_ELEMS, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(7, b + 2 * TILE_ELEMS, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, b + 3 * TILE_ELEMS, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
                if (rounds > 1) store_accumulators(round);
            }
        }
        if (rounds == 1) store_accumulators(0);
    }

    void load_accumulators(int round) {
        float* acc = acc_.data() + 64 * round;
        _tile_loadd(0, acc, D * 4);
        _tile_loadd(1, acc + 16, D * 4);
        _tile_loadd(2, acc + 32, D * 4);
        _tile_loadd(3, acc + 48, D * 4);
    }

    void store_accumulators(int round) {
        float* acc = acc_.data() + 64 * round;
        _tile_stored(0, acc, D * 4);
        _tile_stored(1, acc + 16, D * 4);
        _tile_stored(2, acc + 32, D * 4);
        _tile_stored(3, acc + 48, D * 4);
    }

    // v_tiles_[buffer][j][e] for positions p0 .. p0 + 31: row r holds V[p0 + 2r] and
    // V[p0 + 2r + 1] interleaved, 16 columns of each; positions past the context are 0.
    // The columns come in unpack order, not head_dim's: of d in c .. c + 31, tile c / 16 holds
    // c + 0-3, 8-11, 16-19, 24-27 and the next tile the rest, which attend() undoes.
    void pack_values(const HeadTile& t, int64_t p0, uint16_t* tiles) {
        for (int half = 0; half < 2; ++half) {
            const int64_t start = p0 + half * ROWS;  // 16 positions in one block
            if (start >= ctx_) {
                for (int j = 0; j < t.kvs; ++j) {
                    for (int e = 0; e < DV; ++e) {
                        std::memset(tiles + (j * DV + e) * TILE_ELEMS + half * 8 * 32, 0, 8 * 64);
                    }
                }
                continue;
            }
            const uint16_t* base = v_ + at_.at(start) + static_cast<int64_t>(t.kv0) * D;
            for (int r = 0; r < 8; ++r) {
                const int64_t a = start + 2 * r;
                const uint16_t* row_a = base + 2 * r * at_.row_width;
                const uint16_t* row_b = row_a + at_.row_width;
                for (int j = 0; j < t.kvs; ++j) {
                    uint16_t* dst = tiles + j * DV * TILE_ELEMS + (half * 8 + r) * 32;
                    for (int c = 0; c < D; c += 32) {
                        const __m512i x = a < ctx_ ? _mm512_loadu_si512(row_a + j * D + c)
                                                   : _mm512_setzero_si512();
                        const __m512i y = a + 1 < ctx_ ? _mm512_loadu_si512(row_b + j * D + c)
                                                       : _mm512_setzero_si512();
                        _mm512_storeu_si512(dst + (c / 16) * TILE_ELEMS,
                                            _mm512_unpacklo_epi16(x, y));
                        _mm512_storeu_si512(dst + (c / 16 + 1) * TILE_ELEMS,
                                            _mm512_unpackhi_epi16(x, y));
                    }
                }
            }
        }
    }

    int64_t stride_;  // weights_'s row length: the longest context, in whole 32-position chunks
    std::vector<uint16_t> q_tiles_, weights_, v_tiles_;
    std::vector<float> scores_, acc_;
    const uint16_t *k_ = nullptr, *v_ = nullptr;
    Positions at_{};
    int64_t ctx_ = 0;
    float inv_sums_[ROWS] = {};
};

template <int D>
void decode_batch(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                  const int64_t* block_tables, int64_t max_blocks, const int64_t* context_lens,
                  int batch, int heads, int kv_heads, int block_size, float scale,
                  uint16_t* out) {
    const int group = heads / kv_heads;
    const int per_tile = ROWS / group;  // KV heads whose groups fill one tile's 16 columns
    const int64_t row_width = static_cast<int64_t>(kv_heads) * D;
    int64_t longest = 1;
    for (int b = 0; b < batch; ++b) longest = context_lens[b] > longest ? context_lens[b] : longest;
#pragma omp parallel
    {
        configure_tiles();
        Workspace<D> work(per_tile < kv_heads ? per_tile : kv_heads, longest);
#pragma omp for schedule(dynamic, 1)
        for (int b = 0; b < batch; ++b) {
            const int64_t ctx = context_lens[b];
            const int64_t at = static_cast<int64_t>(b) * heads * D;
            if (ctx <= 0) {
                std::memset(out + at, 0, sizeof(uint16_t) * heads * D);
                continue;
            }
            const Positions positions{block_tables + b * max_blocks, block_size,
                                      row_width * block_size, row_width};
            for (int kv0 = 0; kv0 < kv_heads; kv0 += per_tile) {
                const HeadTile t{kv0, kv_heads - kv0 < per_tile ? kv_heads - kv0 : per_tile,
                                 group};
                const int64_t first = static_cast<int64_t>(kv0) * group * D;
                work.attend(k_cache, v_cache, positions, ctx, q + at + first, t, scale,
                            out + at + first);
            }
        }
        _tile_release();
    }
}

}  // namespace
#endif

bool amx_applies(int heads, int kv_heads, int head_dim, int block_size) {
#if defined(KERNELS_AMX)
    const bool shape = kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= ROWS;
    return shape && block_size % ROWS == 0 && (head_dim == 64 || head_dim == 128) &&
           tiles_permitted();
#else
    (void)heads, (void)kv_heads, (void)head_dim, (void)block_size;
    return false;
#endif
}

bool decode_amx(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                const int64_t* block_tables, int64_t max_blocks, const int64_t* context_lens,
                int batch, int heads, int kv_heads, int head_dim, int block_size, float scale,
                uint16_t* out) {
#if defined(KERNELS_AMX)
    if (!amx_applies(heads, kv_heads, head_dim, block_size)) return false;
    if (head_dim == 64) {
        decode_batch<64>(q, k_cache, v_cache, block_tables, max_blocks, context_lens, batch,
                         heads, kv_heads, block_size, scale, out);
    } else {
        decode_batch<128>(q, k_cache, v_cache, block_tables, max_blocks, context_lens, batch,
                          heads, kv_heads, block_size, scale, out);
    }
    return true;
#else
    (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)max_blocks;
    (void)context_lens, (void)batch, (void)heads, (void)kv_heads, (void)head_dim;
    (void)block_size, (void)scale, (void)out;
    return false;
#endif
}

bool amx_built() {
#if defined(KERNELS_AMX)
    return true;
#else
    return false;
#endif
}

}  // namespace kernels
