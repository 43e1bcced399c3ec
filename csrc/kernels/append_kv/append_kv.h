// Host entry point of the KV-cache append kernel (torch-free; csrc/backends/append_kv_cuda.cu
// fills the params).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/launch_status.h"
#include "../common/scalar_type.h"

namespace astrai::kernels {

// k_cache[slot / S, slot % S, h, :] = k[t, h, :] (same for v) for every token t whose
// slot_mapping[t] = slot is in [0, P * S); other slots (negative: padding) skip the token.
struct AppendKVParams {
  const void* k;                // [T, Hkv, D], last dim contiguous
  const void* v;                // [T, Hkv, D], last dim contiguous
  void* k_cache;                // [P, S, Hkv, D], last dim contiguous
  void* v_cache;                // [P, S, Hkv, D], last dim contiguous
  const int32_t* slot_mapping;  // [T] int32, page * S + offset; negative = skip the token
  int64_t k_stride_token;       // elements between k[t] and k[t + 1]
  int64_t k_stride_head;        // elements between k[t, h] and k[t, h + 1]
  int64_t v_stride_token;
  int64_t v_stride_head;
  int64_t k_cache_stride_page;  // elements between pages of k_cache
  int64_t k_cache_stride_slot;  // elements between slots of one page
  int64_t k_cache_stride_head;  // elements between heads of one slot
  int64_t v_cache_stride_page;
  int64_t v_cache_stride_slot;
  int64_t v_cache_stride_head;
  int num_tokens;     // T
  int num_kv_heads;   // Hkv
  int head_dim;       // D; D * element size must be a multiple of 16 bytes
  int page_size;      // S (any positive value works here)
  int64_t num_pages;  // P
  ScalarType dtype;
};

LaunchStatus launch_append_kv(const AppendKVParams& params, cudaStream_t stream);

}  // namespace astrai::kernels
