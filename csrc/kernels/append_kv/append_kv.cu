// KV append: copies each new token's k/v rows into its cache slot, 16 bytes per thread.
#include <cuda_runtime.h>

#include "append_kv.h"

namespace astrai::kernels {

namespace {

// One thread per 16-byte chunk of one (token, head) row of k and of v: consecutive threads take
// consecutive chunks of a row, so a warp reads and writes whole contiguous rows.
__global__ void append_kv_kernel(const __grid_constant__ AppendKVParams p, int element_size,
                                 int chunks_per_row) {
  const int64_t item = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t total = (int64_t)p.num_tokens * p.num_kv_heads * chunks_per_row;
  if (item >= total) return;
  const int chunk = item % chunks_per_row;
  const int64_t row = item / chunks_per_row;
  const int head = row % p.num_kv_heads;
  const int token = row / p.num_kv_heads;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0 || slot >= p.num_pages * p.page_size) return;
  const int64_t page = slot / p.page_size;
  const int64_t offset = slot % p.page_size;
  const int64_t byte = (int64_t)chunk * 16;
  const char* k_src = static_cast<const char*>(p.k) +
                      (token * p.k_stride_token + head * p.k_stride_head) * element_size + byte;
  const char* v_src = static_cast<const char*>(p.v) +
                      (token * p.v_stride_token + head * p.v_stride_head) * element_size + byte;
  char* k_dst = static_cast<char*>(p.k_cache) +
                (page * p.k_cache_stride_page + offset * p.k_cache_stride_slot +
                 head * p.k_cache_stride_head) *
                    element_size +
                byte;
  char* v_dst = static_cast<char*>(p.v_cache) +
                (page * p.v_cache_stride_page + offset * p.v_cache_stride_slot +
                 head * p.v_cache_stride_head) *
                    element_size +
                byte;
  const uint4 k_value = __ldg(reinterpret_cast<const uint4*>(k_src));
  const uint4 v_value = __ldg(reinterpret_cast<const uint4*>(v_src));
  *reinterpret_cast<uint4*>(k_dst) = k_value;
  *reinterpret_cast<uint4*>(v_dst) = v_value;
}

}  // namespace

LaunchStatus launch_append_kv(const AppendKVParams& params, cudaStream_t stream) {
  const int element_size = element_bytes(params.dtype);
  if (element_size == 0) return {"append_kv: unsupported dtype"};
  const int row_bytes = params.head_dim * element_size;
  if (row_bytes % 16 != 0)
    return {"append_kv: head_dim * element size must be a multiple of 16 bytes"};
  if (params.page_size <= 0) return {"append_kv: page size must be positive"};
  if (params.num_tokens == 0 || params.num_kv_heads == 0) return {};
  const int chunks_per_row = row_bytes / 16;
  const int64_t total = (int64_t)params.num_tokens * params.num_kv_heads * chunks_per_row;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  if (blocks > INT32_MAX) return {"append_kv: too many tokens for one launch"};
  append_kv_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params, element_size,
                                                                          chunks_per_row);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return {std::string("append_kv_kernel: ") + cudaGetErrorString(error)};
  return {};
}

}  // namespace astrai::kernels
