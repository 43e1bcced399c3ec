// The latent append: each new token's latent and rotary key into its cache slot, 16 bytes of the
// source rows per thread (params.h: AppendMlaParams).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>

#include "launch.h"

namespace astr::kernels {

namespace {

// The slot of token `token`, or -1 for a skipped token (negative) or one past the pool.
__device__ __forceinline__ int64_t slot_of(const AppendMlaParams& p, int token) {
  const int64_t slot = p.slot_mapping[token];
  return slot < 0 || slot >= p.num_pages * p.page_size ? -1 : slot;
}

// 16 bytes from `src` to `dst`.
__device__ __forceinline__ void copy_16_bytes(const char* src, char* dst) {
  *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
}

// The rotary key's chunk `chunk` of token `token` (its slot known): a copy.
__device__ __forceinline__ void copy_rope_chunk(const AppendMlaParams& p, int token, int64_t slot,
                                                int chunk) {
  const int element = element_bytes(p.krope_dtype);
  const int64_t page = slot / p.page_size, offset = slot % p.page_size;
  const char* src =
      static_cast<const char*>(p.krope) + token * p.krope_stride_token * element + chunk * 16;
  char* dst = static_cast<char*>(p.krope_cache) +
              (page * p.krope_cache_stride_page + offset * p.krope_cache_stride_slot) * element +
              chunk * 16;
  copy_16_bytes(src, dst);
}

// A 16-bit (or float32) latent pool: every chunk of both rows copied. Threads per token:
// latent_chunks, then rope_chunks.
__global__ void append_mla_copy_kernel(const __grid_constant__ AppendMlaParams p, int latent_chunks,
                                       int rope_chunks) {
  const int per_token = latent_chunks + rope_chunks;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(p.num_tokens) * per_token) return;
  const int token = static_cast<int>(item / per_token);
  const int chunk = static_cast<int>(item % per_token);
  const int64_t slot = slot_of(p, token);
  if (slot < 0) return;
  if (chunk >= latent_chunks) return copy_rope_chunk(p, token, slot, chunk - latent_chunks);
  const int element = element_bytes(p.ckv_dtype);
  const int64_t page = slot / p.page_size, offset = slot % p.page_size;
  const char* src =
      static_cast<const char*>(p.ckv) + token * p.ckv_stride_token * element + chunk * 16;
  char* dst = static_cast<char*>(p.ckv_cache) +
              (page * p.ckv_cache_stride_page + offset * p.ckv_cache_stride_slot) * element +
              chunk * 16;
  copy_16_bytes(src, dst);
}

// (torch's extension flags turn off __half's and __nv_bfloat16's implicit conversions.)
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// An FP8 latent pool: each 16 bytes of the latent row (16 / sizeof(T) values) quantized with the
// layer's scale (an exact division, not fast-math's), saturating at e4m3's largest finite value as
// the contract's clamp does (NaN stays NaN), and written as that many bytes.
template <typename T>
__global__ void append_mla_fp8_kernel(const __grid_constant__ AppendMlaParams p, int latent_chunks,
                                      int rope_chunks) {
  constexpr int kPerChunk = 16 / sizeof(T);
  const int per_token = latent_chunks + rope_chunks;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(p.num_tokens) * per_token) return;
  const int token = static_cast<int>(item / per_token);
  const int chunk = static_cast<int>(item % per_token);
  const int64_t slot = slot_of(p, token);
  if (slot < 0) return;
  if (chunk >= latent_chunks) return copy_rope_chunk(p, token, slot, chunk - latent_chunks);
  const int64_t page = slot / p.page_size, offset = slot % p.page_size;
  const T* src = static_cast<const T*>(p.ckv) + token * p.ckv_stride_token + chunk * kPerChunk;
  uint8_t* dst = static_cast<uint8_t*>(p.ckv_cache) + page * p.ckv_cache_stride_page +
                 offset * p.ckv_cache_stride_slot + chunk * kPerChunk;
  const float scale = *p.ckv_scale;
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
  const T* x = reinterpret_cast<const T*>(&raw);
  alignas(8) uint8_t bytes[kPerChunk];  // stored as one 8- or 4-byte word
#pragma unroll
  for (int i = 0; i < kPerChunk; ++i)
    bytes[i] = __nv_cvt_float_to_fp8(__fdiv_rn(to_float(x[i]), scale), __NV_SATFINITE, __NV_E4M3);
  if constexpr (kPerChunk == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(bytes);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(bytes);
  }
}

}  // namespace

LaunchStatus launch_append_mla(const AppendMlaParams& p, cudaStream_t stream) {
  const bool fp8 = p.ckv_cache_dtype == ScalarType::kFloat8E4M3;
  const int latent_bytes = p.latent_dim * element_bytes(p.ckv_dtype);
  const int rope_bytes = p.rope_dim * element_bytes(p.krope_dtype);
  if (latent_bytes % 16 != 0 || rope_bytes % 16 != 0 || latent_bytes == 0 || rope_bytes == 0)
    return {"append_mla: rows of ckv and krope must be multiples of 16 bytes"};
  if (fp8 && p.ckv_scale == nullptr) return {"append_mla: an FP8 latent pool needs ckv_scale"};
  if (!fp8 && p.ckv_cache_dtype != p.ckv_dtype)
    return {"append_mla: ckv must have the latent pool's dtype"};
  if (p.page_size <= 0) return {"append_mla: page size must be positive"};
  if (p.num_tokens == 0) return {};
  const int latent_chunks = latent_bytes / 16, rope_chunks = rope_bytes / 16;
  const int64_t total = static_cast<int64_t>(p.num_tokens) * (latent_chunks + rope_chunks);
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  if (blocks > INT32_MAX) return {"append_mla: too many tokens for one launch"};
  const unsigned grid = static_cast<unsigned>(blocks);
  if (!fp8) {
    append_mla_copy_kernel<<<grid, threads, 0, stream>>>(p, latent_chunks, rope_chunks);
    return status_after_launch("append_mla_copy_kernel");
  }
  switch (p.ckv_dtype) {
    case ScalarType::kBFloat16:
      append_mla_fp8_kernel<__nv_bfloat16>
          <<<grid, threads, 0, stream>>>(p, latent_chunks, rope_chunks);
      break;
    case ScalarType::kFloat16:
      append_mla_fp8_kernel<__half><<<grid, threads, 0, stream>>>(p, latent_chunks, rope_chunks);
      break;
    case ScalarType::kFloat32:
      append_mla_fp8_kernel<float><<<grid, threads, 0, stream>>>(p, latent_chunks, rope_chunks);
      break;
    default:
      return {"append_mla: an FP8 latent pool takes bfloat16, float16 or float32 latents"};
  }
  return status_after_launch("append_mla_fp8_kernel");
}

}  // namespace astr::kernels
