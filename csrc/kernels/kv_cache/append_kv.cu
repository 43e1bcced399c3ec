// KV append: copies each new token's k/v rows into its cache slot, 16 bytes per thread.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kv_cache.h"

namespace astr::kernels {

namespace {

// One thread per 16-byte chunk of one (token, head) row of k and of v: consecutive threads take
// consecutive chunks of a row, so a warp reads and writes whole contiguous rows. Where v's rows are
// narrower (k_chunks > v_chunks), the chunks past v's copy k's only.
__global__ void append_kv_kernel(const __grid_constant__ AppendKVParams p, int element_size,
                                 int k_chunks, int v_chunks) {
  const int chunks_per_row = max(k_chunks, v_chunks);
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
  if (chunk < k_chunks)
    *reinterpret_cast<uint4*>(k_dst) = __ldg(reinterpret_cast<const uint4*>(k_src));
  if (chunk < v_chunks)
    *reinterpret_cast<uint4*>(v_dst) = __ldg(reinterpret_cast<const uint4*>(v_src));
}

// FP8 pools: one thread per 16 bytes of a (token, head) row of k and of v (16 / sizeof(T)
// elements), quantized with the head's scale (an exact division, not fast-math's) and written as
// that many bytes. The conversion saturates at the format's largest finite value, as the clamp
// the contract names does, and keeps NaN.
// (torch's extension flags turn off __half's and __nv_bfloat16's implicit conversions.)
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void append_kv_fp8_kernel(const __grid_constant__ AppendKVParams p, int k_chunks,
                                     int v_chunks) {
  constexpr int kPerChunk = 16 / sizeof(T);
  const int chunks_per_row = max(k_chunks, v_chunks);
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
  const int64_t column = (int64_t)chunk * kPerChunk;
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    if (chunk >= (which == 0 ? k_chunks : v_chunks)) continue;  // past v's narrower row
    const T* src = static_cast<const T*>(which == 0 ? p.k : p.v) +
                   token * (which == 0 ? p.k_stride_token : p.v_stride_token) +
                   head * (which == 0 ? p.k_stride_head : p.v_stride_head) + column;
    uint8_t* dst = static_cast<uint8_t*>(which == 0 ? p.k_cache : p.v_cache) +
                   page * (which == 0 ? p.k_cache_stride_page : p.v_cache_stride_page) +
                   offset * (which == 0 ? p.k_cache_stride_slot : p.v_cache_stride_slot) +
                   head * (which == 0 ? p.k_cache_stride_head : p.v_cache_stride_head) + column;
    const float scale = (which == 0 ? p.k_scale : p.v_scale)[head];
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
    const T* x = reinterpret_cast<const T*>(&raw);
    uint8_t bytes[kPerChunk];
#pragma unroll
    for (int i = 0; i < kPerChunk; ++i)
      bytes[i] = __nv_cvt_float_to_fp8(__fdiv_rn(to_float(x[i]), scale), __NV_SATFINITE, kFormat);
    if constexpr (kPerChunk == 8) {
      *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(bytes);
    } else {
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(bytes);
    }
  }
}

template <__nv_fp8_interpretation_t kFormat>
LaunchStatus launch_fp8(const AppendKVParams& p, int k_chunks, int v_chunks, unsigned blocks,
                        int threads, cudaStream_t stream) {
  switch (p.dtype) {
    case ScalarType::kBFloat16:
      append_kv_fp8_kernel<__nv_bfloat16, kFormat>
          <<<blocks, threads, 0, stream>>>(p, k_chunks, v_chunks);
      break;
    case ScalarType::kFloat16:
      append_kv_fp8_kernel<__half, kFormat><<<blocks, threads, 0, stream>>>(p, k_chunks, v_chunks);
      break;
    case ScalarType::kFloat32:
      append_kv_fp8_kernel<float, kFormat><<<blocks, threads, 0, stream>>>(p, k_chunks, v_chunks);
      break;
    default:
      return {"append_kv: an FP8 pool takes bfloat16, float16 or float32 tokens"};
  }
  return status_after_launch("append_kv_fp8_kernel");
}

}  // namespace

LaunchStatus launch_append_kv(const AppendKVParams& params, cudaStream_t stream) {
  const int element_size = element_bytes(params.dtype);
  if (element_size == 0) return {"append_kv: unsupported dtype"};
  // An FP8 pool's thread converts 16 bytes of the input into 16 / element size bytes: chunks count
  // the same either way.
  const int k_row_bytes = params.head_dim * element_size;
  const int v_row_bytes = params.head_dim_v * element_size;
  if (k_row_bytes % 16 != 0 || v_row_bytes % 16 != 0 || params.head_dim_v <= 0)
    return {"append_kv: head_dim * element size must be a multiple of 16 bytes"};
  if (params.page_size <= 0) return {"append_kv: page size must be positive"};
  if (params.num_tokens == 0 || params.num_kv_heads == 0) return {};
  const int k_chunks = k_row_bytes / 16, v_chunks = v_row_bytes / 16;
  const int chunks_per_row = std::max(k_chunks, v_chunks);
  const int64_t total = (int64_t)params.num_tokens * params.num_kv_heads * chunks_per_row;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  if (blocks > INT32_MAX) return {"append_kv: too many tokens for one launch"};
  if (is_fp8(params.cache_dtype)) {
    if (params.k_scale == nullptr || params.v_scale == nullptr)
      return {"append_kv: an FP8 pool needs k_scale and v_scale"};
    return params.cache_dtype == ScalarType::kFloat8E4M3
               ? launch_fp8<__NV_E4M3>(params, k_chunks, v_chunks, static_cast<unsigned>(blocks),
                                       threads, stream)
               : launch_fp8<__NV_E5M2>(params, k_chunks, v_chunks, static_cast<unsigned>(blocks),
                                       threads, stream);
  }
  append_kv_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(params, element_size,
                                                                          k_chunks, v_chunks);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return {std::string("append_kv_kernel: ") + cudaGetErrorString(error)};
  return {};
}

}  // namespace astr::kernels
