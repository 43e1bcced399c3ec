// The query rows of one block and what they see, shared by the paged attention kernels (mma.sync,
// paged_attention_kernel.cuh, and wgmma, paged_prefill_wgmma_kernel.cuh).
//
// Rows pack (new token, q head of the GQA group): row r of kv head h is new token r / G of the
// sequence, q head h * G + r % G (G = num_q_heads / num_kv_heads). New token i of a sequence sits
// at kv position first_pos + i, first_pos = seq_len - q_len.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "device_primitives.cuh"
#include "launch.h"
#include "paged_attention_params.h"

namespace astrai::kernels {

// End of the kv positions that rows [row0, row0 + block_rows) can see: the sequence, the causal
// edge of the block's last token, the mask's width.
__device__ __forceinline__ int block_kv_end(const PagedAttentionParams& p, int seq_len,
                                            int first_pos, int row0, int block_rows, int num_rows,
                                            int group) {
  int kv_end = seq_len;
  if (p.is_causal) {
    const int last_token = (min(row0 + block_rows, num_rows) - 1) / group;
    kv_end = min(kv_end, first_pos + last_token + 1);
  }
  if (p.attn_mask != nullptr) kv_end = min(kv_end, p.mask_kv_len);
  return kv_end;
}

// Starts the cp.async copies of the block's kRows query rows into shared memory; element
// offset(r, chunk) places 16-byte chunk `chunk` of row r. Rows past num_rows are zero-filled.
template <typename T, int kRows, int kChunks, int kThreads, typename Offset>
__device__ __forceinline__ void load_query_rows(const PagedAttentionParams& p, T* q_smem, int tid,
                                                int q_start, int row0, int num_rows, int group,
                                                int kv_head, Offset offset) {
  const T* q_base = static_cast<const T*>(p.q);
#pragma unroll
  for (int i = 0; i < kRows * kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int r = c / kChunks, ch = c % kChunks;
    const int row = row0 + r;
    const bool valid = row < num_rows;
    const T* src = q_base;
    if (valid) {
      const int token = q_start + row / group;
      const int head = kv_head * group + row % group;
      src = q_base + token * p.q_stride_token + head * p.q_stride_head + ch * 8;
    }
    cp_async_16(shared_address(q_smem + offset(r, ch)), src, valid);
  }
}

// What one query row sees of a tile: positions below `limit` (its causal edge and the block's
// kv_end) where its mask row, if any, is true.
struct RowVisibility {
  int limit;
  const bool* mask_row;  // null without a mask
};
__device__ __forceinline__ RowVisibility row_visibility(const PagedAttentionParams& p, int row,
                                                        int num_rows, int group, int q_start,
                                                        int first_pos, int kv_end) {
  const int token = min(row, max(num_rows - 1, 0)) / group;  // padding rows: clamp, never read
  const int causal_end = p.is_causal ? first_pos + token + 1 : kv_end;
  RowVisibility v;
  v.limit = min(kv_end, causal_end);
  v.mask_row = p.attn_mask != nullptr
                   ? p.attn_mask + (int64_t)(q_start + token) * p.mask_stride_token
                   : nullptr;
  return v;
}
__device__ __forceinline__ bool visible(const RowVisibility& v, int pos) {
  bool keep = pos < v.limit;
  if (v.mask_row != nullptr && keep) keep = v.mask_row[pos];
  return keep;
}

// Host: lets `kernel` use `smem_bytes` of dynamic shared memory and sets the grid every paged
// attention launch uses: x = (sequence, kv head) pairs of `p`, y = the row tiles of `block_rows`
// rows that cover grid_rows rows (at most 65535), z = grid_z.
template <typename Kernel>
LaunchStatus prepare_row_tile_launch(Kernel kernel, int smem_bytes, const PagedAttentionParams& p,
                                     int grid_rows, int block_rows, int grid_z, dim3* grid) {
  const cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (error != cudaSuccess)
    return {std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(error)};
  const int64_t row_tiles = (grid_rows + block_rows - 1) / block_rows;
  if (row_tiles > 65535) return {"paged attention: too many query rows for one launch"};
  const int64_t seq_heads = (int64_t)p.num_seqs * p.num_kv_heads;
  *grid = dim3(static_cast<unsigned>(seq_heads), static_cast<unsigned>(row_tiles),
               static_cast<unsigned>(grid_z));
  return {};
}

}  // namespace astrai::kernels
