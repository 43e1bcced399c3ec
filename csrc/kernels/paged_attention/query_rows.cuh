// The query rows of one block (variant.cuh says how rows pack (token, q head) pairs): their copy
// into shared memory, and the grid every row-tiled launch uses.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "params.h"

namespace astrai::kernels {

// Starts the cp.async copies of the block's kRows query rows into shared memory; element
// offset(r, chunk) places 16-byte chunk `chunk` of row r. Rows past num_rows are zero-filled.
template <typename T, int kRows, int kChunks, int kThreads, typename Offset>
__device__ __forceinline__ void load_query_rows(const PagedAttentionParams& p, T* q_smem, int tid,
                                                int q_start, int row0, int num_rows, int group,
                                                int kv_head, Offset offset) {
  const T* q_base = static_cast<const T*>(p.q);
  constexpr int kCopies = kRows * kChunks;
#pragma unroll
  for (int i = 0; i < (kCopies + kThreads - 1) / kThreads; ++i) {
    const int c = tid + i * kThreads;
    if (kCopies % kThreads != 0 && c >= kCopies) break;
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
