// Host entry points of the KV-cache kernels (torch-free; the bindings in csrc/backends fill the
// params): the append (append_kv.cu) and the dequantization of an FP8 cache's pages for a prefill
// (dequantize_pages.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/launch_status.h"
#include "../common/scalar_type.h"

namespace astr::kernels {

// k_cache[slot / S, slot % S, h, :] = k[t, h, :] (same for v) for every token t whose
// slot_mapping[t] = slot is in [0, P * S); other slots (negative: padding) skip the token. FP8
// pools store fp8(clamp(k[t, h, :] / k_scale[h], -max, max)), rounded to nearest even (torch's
// cast after the clamp).
struct AppendKVParams {
  const void* k;                // [T, Hkv, D], last dim contiguous
  const void* v;                // [T, Hkv, DV], last dim contiguous
  void* k_cache;                // [P, S, Hkv, D], last dim contiguous
  void* v_cache;                // [P, S, Hkv, DV], last dim contiguous
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
  int num_tokens;          // T
  int num_kv_heads;        // Hkv
  int head_dim;            // D; D * element size must be a multiple of 16 bytes
  int head_dim_v;          // DV (DeepSeek's MHA form: 128 beside D = 192), the same rule
  int page_size;           // S (any positive value works here)
  int64_t num_pages;       // P
  ScalarType dtype;        // of k and v
  ScalarType cache_dtype;  // dtype, or an FP8 type
  const float* k_scale;    // FP8 pools: [Hkv] float32
  const float* v_scale;
};

LaunchStatus launch_append_kv(const AppendKVParams& params, cudaStream_t stream);

// The pages a prefill reads of an FP8 cache, dequantized into a pool of q's dtype while that
// scratch stays within plan.h's limit (prefill_dequantizes_fp8_first; beyond it the wgmma or the
// mma.sync prefill reads the bytes itself): page w of sequence b (block_table[b][w])
// becomes page b * W + w of `out`, every element stored.float() * scale[kv head], for the pages its
// length uses (at most W). A page id outside the pool is not read: its page is filled with NaN, so
// the sequence's rows come out NaN, as the other kernels poison them (params.h).
struct DequantizePagesParams {
  const void* k_cache;  // [P, S, Hkv, D] FP8, last dim contiguous
  const void* v_cache;
  int64_t k_stride_page, k_stride_slot, k_stride_head;  // elements
  int64_t v_stride_page, v_stride_slot, v_stride_head;
  ScalarType cache_dtype;      // kFloat8E4M3 or kFloat8E5M2
  const float* k_scale;        // [Hkv]
  const float* v_scale;        // [Hkv]
  const int32_t* block_table;  // [B, W] int32
  int64_t block_table_stride;
  const int32_t* seq_lens;  // [B]
  void* k_out;              // [B * W, S, Hkv, D] contiguous, out_dtype
  void* v_out;
  ScalarType out_dtype;  // kBFloat16 or kFloat16
  int num_seqs;          // B
  int width;             // W
  int page_size;         // S
  int num_kv_heads;      // Hkv
  int head_dim;          // D, a multiple of 16
  int64_t num_pages;     // P
};

LaunchStatus launch_dequantize_pages(const DequantizePagesParams& params, cudaStream_t stream);

}  // namespace astr::kernels
