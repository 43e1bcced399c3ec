// Tensor maps of the paged pool for the tensor memory accelerator (TMA, sm_90): a kernel copies a
// box of `box rows` consecutive slots x 64 columns of one (page, kv head) with one instruction,
// which completes on an mbarrier, instead of a thread per 16 bytes computing addresses and issuing
// cp.async (kv_tile_loader.cuh). The warp-specialised prefill's producer uses them for its tiles
// (prefill_warp_specialized_kernel.cuh): the copies' address arithmetic was most of its
// instructions.
//
// A map describes the whole pool: dims (64-column blocks of D, and the pool's slot, head and page
// dims ordered by their strides, as the driver expects increasing strides), boxes of 64 columns x
// box rows slots, written into shared memory in the 128-byte swizzled layout wgmma reads
// (swizzled_128b_tile_offset: a box of R rows lands as R rows of 128 bytes, the swizzle taken from
// the shared address, so every box starts on a 1024-byte boundary: R >= 8).
//
// Boxes are whole: a box starts at a multiple of R slots and R divides the page size and the
// tile's rows, so a tile's boxes never cross a page. Head dims of whole 32-column halves: at
// D = 96 the second column block's box reaches past D and reads zeros there (the kernel's rows
// are padded to whole column blocks, and the multiplies never read the pad). A coordinate outside
// the pool (a page id outside [0, num_pages)) reads nothing and fills zeros: no block-table value
// makes a box read outside the pool.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace astr::kernels {

// The K and V maps of one call, passed to the kernel as a __grid_constant__ parameter (the
// instruction reads the map from there). log2_box_rows == 0: no maps (page sizes below 8, strides
// the TMA cannot describe, or a driver without the entry point): the kernel gathers with cp.async.
struct PoolTensorMaps {
  CUtensorMap k, v;
  int log2_box_rows;
  // Where the slot, head and page coordinates go among the map's dims 1..3.
  int slot_dim, head_dim, page_dim;
};

// The smallest box: one 1024-byte swizzle atom of 128-byte rows.
inline constexpr int kMinPoolBoxRows = 8;

// Host: maps of p's K and V pools for tiles of tile_rows slots (box rows: the largest power of two
// dividing both tile_rows and the page size, at most 256). Returns false, with maps->log2_box_rows
// = 0, where the pool cannot be described (see above); 16-bit caches only.
bool encode_pool_tensor_maps(const PagedAttentionParams& p, int tile_rows, PoolTensorMaps* maps);

#if defined(__CUDACC__)
// Device: the TMA copy of one box, (column, slot, head, page) its first element, into shared
// memory at `dst` (a shared address on a 1024-byte boundary), counted in bytes on `barrier`.
// shared::cluster with the block's own address: the form every sm_90 toolkit takes (a block
// outside a cluster is a cluster of one).
__device__ __forceinline__ void copy_pool_box(uint32_t dst, const PoolTensorMaps& maps,
                                              const CUtensorMap& map, uint32_t barrier, int column,
                                              int slot, int head, int page) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int c1 = maps.slot_dim == 1 ? slot : maps.head_dim == 1 ? head : page;
  const int c2 = maps.slot_dim == 2 ? slot : maps.head_dim == 2 ? head : page;
  const int c3 = maps.slot_dim == 3 ? slot : maps.head_dim == 3 ? head : page;
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(column), "r"(c1), "r"(c2), "r"(c3), "r"(barrier)
      : "memory");
#endif
}

// Device: fetch a map into the TMA unit's cache ahead of its first use.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap& map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
#endif
}
#endif  // __CUDACC__

}  // namespace astr::kernels
