// Device-side token carry-over and KV writes for the CUDA device.
// Loaded at run time with CuPy RawModule (streams/cuda_kernels.py); compiled by nvcc in CI.

extern "C" __global__ void fill_placeholders(
    long long* input_ids,          // [T] in/out: -1 marks "the token last sampled for my slot"
    const long long* token_slots,  // [T] request slot of each input token
    const long long* token_buffer, // [num_slots] last sampled token per slot
    int num_tokens)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < num_tokens && input_ids[i] < 0) {
        input_ids[i] = token_buffer[token_slots[i]];
    }
}

extern "C" __global__ void scatter_tokens(
    long long* token_buffer,       // [num_slots] out
    const long long* slots,        // [S] slot of each sampled row
    const long long* tokens,       // [S] sampled tokens
    int num_rows)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < num_rows) {
        token_buffer[slots[i]] = tokens[i];
    }
}
