// Write the K and V of new tokens into the paged cache: one thread block per token.
// Cache layout: [num_blocks * block_size, num_kv_heads * head_dim] (row = KV slot).
//
// No headers: the store moves 16-bit words and does no arithmetic, so bfloat16 and float16
// are both unsigned shorts here. NVRTC ships no cuda_bf16.h / cuda_fp16.h, and CuPy's CUDA
// 13 wheels no longer bundle them: a kernel that included them would not compile there.

template <typename T>
__device__ void store_kv_impl(
    T* k_cache, T* v_cache, const T* k, const T* v,
    const long long* slot_mapping, int row_width)
{
    long long slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;  // padding token: nothing to store
    const T* k_row = k + (long long)blockIdx.x * row_width;
    const T* v_row = v + (long long)blockIdx.x * row_width;
    T* k_dst = k_cache + slot * row_width;
    T* v_dst = v_cache + slot * row_width;
    for (int j = threadIdx.x; j < row_width; j += blockDim.x) {
        k_dst[j] = k_row[j];
        v_dst[j] = v_row[j];
    }
}

extern "C" __global__ void store_kv_bf16(
    unsigned short* k_cache, unsigned short* v_cache, const unsigned short* k,
    const unsigned short* v, const long long* slot_mapping, int row_width)
{
    store_kv_impl(k_cache, v_cache, k, v, slot_mapping, row_width);
}

extern "C" __global__ void store_kv_f16(
    unsigned short* k_cache, unsigned short* v_cache, const unsigned short* k,
    const unsigned short* v, const long long* slot_mapping, int row_width)
{
    store_kv_impl(k_cache, v_cache, k, v, slot_mapping, row_width);
}

extern "C" __global__ void store_kv_f32(
    float* k_cache, float* v_cache, const float* k, const float* v,
    const long long* slot_mapping, int row_width)
{
    store_kv_impl(k_cache, v_cache, k, v, slot_mapping, row_width);
}
