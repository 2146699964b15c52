// What the two bf16 prefill kernels (AVX512-BF16 dot products, AMX tiles) share: the task
// list, where a key's row lies in the cache, and the output rows.
#pragma once
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "kernels.h"

#if defined(KERNELS_BF16_FAST)
#include <immintrin.h>

namespace kernels {

constexpr int KEY_TILE = 32;  // keys per tile: two vectors (or tiles) of 16

struct PrefillSeq {
    int64_t q_start, q_len, ctx;
    const int64_t* table;

    // Where `key`'s row for KV head kvh starts in a cache [blocks, block_size, KV, D].
    int64_t key_at(int64_t key, int kvh, int kv_heads, int head_dim, int block_size) const {
        const int64_t row_width = static_cast<int64_t>(kv_heads) * head_dim;
        return (table[key / block_size] * block_size + key % block_size) * row_width +
               static_cast<int64_t>(kvh) * head_dim;
    }
};

// `tokens` query tokens of one sequence from t0, with the query heads of KV head kvh.
struct PrefillTask {
    int seq, kvh;
    int64_t t0;
};

struct PrefillTasks {
    std::vector<PrefillSeq> seqs;
    std::vector<PrefillTask> tasks;
};

// Every chunk cut into tasks of `tokens` query tokens per KV head, the last tokens first
// (they see the most keys), so that threads taking tasks in order finish together.
inline PrefillTasks prefill_tasks(const Paged& cache, const Chunks& chunks, int64_t tokens) {
    PrefillTasks out;
    out.seqs.resize(chunks.num_seqs);
    for (int s = 0; s < chunks.num_seqs; ++s) {
        const int64_t q_len = chunks.q_lens[s];
        out.seqs[s] = {chunks.q_starts[s], q_len, chunks.ctx_lens[s],
                       cache.block_tables + s * cache.max_blocks};
        for (int64_t t0 = (q_len - 1) / tokens * tokens; t0 >= 0; t0 -= tokens)
            for (int kvh = 0; kvh < cache.kv_heads; ++kvh) out.tasks.push_back({s, kvh, t0});
    }
    return out;
}

// acc's rows (token-major: row r is token r / group, head r % group of KV head kvh) divided
// by their sums, rounded to bf16 into out [T, H, D].
template <int D>
inline void write_rows(const float* acc, const float* sum, int rows, const PrefillSeq& seq,
                       int64_t t0, int kvh, int group, int heads, uint16_t* out) {
    for (int r = 0; r < rows; ++r) {
        const int64_t t = r / group;
        const int h = kvh * group + r % group;
        const __m512 inv = _mm512_set1_ps(1.0f / sum[r]);
        uint16_t* orow = out + ((seq.q_start + t0 + t) * heads + h) * D;
        const float* row = acc + static_cast<int64_t>(r) * D;
        for (int d = 0; d < D; d += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + d), inv);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + d),
                                (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
}

}  // namespace kernels
#endif
