// What the exported entry points share: the dtype codes the Python side passes, the paged
// cache's description, and the vector (AVX2/AVX-512, float32 math) kernels' entry points.
#pragma once
#include <cstdint>

namespace kernels {

enum DType : int { F32 = 0, BF16 = 1, F16 = 2 };  // cpu_kernels.DTYPE_CODES

// One layer's paged KV cache as a batch sees it: [num_blocks, block_size, KV, D] each.
struct Paged {
    const void* k_cache;
    const void* v_cache;
    const int64_t* block_tables;  // [S, max_blocks]
    int64_t max_blocks;
    int kv_heads, head_dim, block_size;
};

// Per sequence of a prefill batch: its first row in q, its query count, its context after
// this step (this step's K/V already written to the cache).
struct Chunks {
    const int64_t* q_starts;
    const int64_t* q_lens;
    const int64_t* ctx_lens;
    int num_seqs;
};

// Whether the vector kernels take q of `qt` over a cache of `kt` with this head_dim: a build
// with AVX2+FMA+F16C or AVX-512, head_dim a multiple of the vector width, and the cache in
// q's dtype or q in float32 (a half-precision cache for a float32 model).
bool vec_supported(DType qt, DType kt, int head_dim);

// Decode: one query per sequence, q and out [B, H, D]. False (nothing ran) where
// vec_supported is false.
bool decode_vec(DType qt, DType kt, const void* q, const Paged& cache,
                const int64_t* context_lens, int batch, int heads, float scale, void* out);

// Causal attention of each chunk's query rows of q and out [T, H, D] as decode attends one
// token (a verify step's rows: every token is attended exactly as decoding it alone would),
// every K/V row read once for all of a chunk's tokens. Other rows untouched; false (nothing
// ran) where vec_supported is false.
bool spans_vec(DType qt, DType kt, const void* q, const Paged& cache, const Chunks& chunks,
               int heads, float scale, void* out);

// Causal prefill of each chunk's query rows of q and out [T, H, D]; other rows untouched.
// False (nothing ran) where vec_supported is false.
bool prefill_vec(DType qt, DType kt, const void* q, const Paged& cache, const Chunks& chunks,
                 int heads, float scale, void* out);

// Decode of bf16 q over a bf16 cache on AMX tiles (paged_decode_amx.cpp), arguments as
// paged_decode's. False (nothing ran) without AMX, for head_dim other than 64 and 128,
// blocks not a multiple of 16 positions or query groups over 16 heads.
bool decode_amx(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                const int64_t* block_tables, int64_t max_blocks, const int64_t* context_lens,
                int batch, int heads, int kv_heads, int head_dim, int block_size, float scale,
                uint16_t* out);

// Whether decode_amx runs for this shape here (the build has AMX, Linux grants the tiles).
bool amx_applies(int heads, int kv_heads, int head_dim, int block_size);

// Causal prefill of bf16 q over a bf16 cache on AMX tiles (paged_prefill_amx.cpp), arguments
// as prefill_vec's. False (nothing ran) without AMX or for head_dim other than 64 and 128.
bool prefill_amx(const uint16_t* q, const Paged& cache, const Chunks& chunks, int heads,
                 float scale, uint16_t* out);

// Whether this build has the AMX kernels.
bool amx_built();

}  // namespace kernels
