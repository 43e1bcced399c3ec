// Paged prefill on Hopper's warpgroup multiply (wgmma, sm_90a) and its launcher. The plan picks it
// over prefill_kernel.cuh's mma.sync prefill on sm_90 when the library was built for sm_90a and
// the head dim compiles it (config.h, plan.h).
//
// Same work split and semantics as the mma.sync prefill (traits.h, variant.cuh): a block owns
// kBlockRows packed query rows (new token, q head of the GQA group) of one (sequence, kv head) and
// walks its kv tiles (causal tiles past the block's last token skipped) with the online softmax of
// FlashAttention-2. What changes is the multiply: two warpgroups of 4 warps each own 64 rows, and
// S = Q K^T takes Q and K straight from shared memory (no ldmatrix, no shared-memory traffic
// through registers), O += P V takes P from the S accumulators (registers) and V from shared
// memory. Q, K and V tiles are in the 128-byte swizzled layout the descriptors describe
// (common/wgmma_primitives.cuh); K/V come in through the same paged cp.async loader as the other
// kernels.
//
// The multiplies run asynchronously, so the loop is a software pipeline: the scores of tile t + 1
// are multiplied while the threads run the softmax of tile t, then O += P V of tile t (3 stages:
// tile t in use, t + 1 landed, t + 2 in flight). That needs two score tiles in registers next to
// O; with 96-wide kv tiles they fit in 254 registers without spills (128-wide: 192 bytes of
// spills). H200, causal bf16, bench_attention.py --quick, geomean over the D = 128 rows against
// the mma.sync kernel: no overlap with 128-wide tiles and 2 stages 1.147x, overlap with 128-wide
// tiles 1.136x, overlap with 96-wide tiles 1.183x (this kernel).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "../common/wgmma_primitives.cuh"
#include "instantiations.h"
#include "kv_tile_loader.cuh"
#include "params.h"
#include "query_rows.cuh"
#include "variant.cuh"
#include "wgmma_row_tile.cuh"

namespace astrai::kernels {

template <int kHeadDim_>
struct PrefillWgmmaTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kDecode = false;
  static constexpr int kWarpGroups = 2;
  static constexpr int kThreads = kWarpGroups * 128;
  static constexpr int kGroups = 1;  // the K/V loader's barriers span the whole block
  static constexpr int kBlockRows = kWarpGroups * 64;  // 64 rows per warpgroup (wgmma's M)
  // kv positions per tile (S's N), see top; D = 64 multiplies half as much per tile, so it takes
  // wider tiles to carry each tile's fixed work (the barrier, the copies' issue).
  static constexpr int kTileN = kHeadDim == 64 ? 128 : 96;
  static constexpr int kStages = 3;  // tile t in use, t + 1 landed, t + 2 in flight
  static constexpr int kElementBytes = 2;
  static constexpr int kChunksPerRow = kHeadDim * kElementBytes / 16;
  static constexpr int kKVBytes =
      kElementBytes;  // FP8 pages reach it dequantized (dequantize_pages.cu)
  static constexpr int kKVChunksPerRow = kChunksPerRow;
  static constexpr bool kWgmmaTiles = true;
  static constexpr bool kPageIdRing = false;  // page ids into registers (kv_tile_loader.cuh)
  static constexpr int kPageIdSlots = 0;
  static constexpr int kTileElements = kTileN * kHeadDim;
  static constexpr int kQElements = kBlockRows * kHeadDim;
  // + 1024: the tiles start on the first 1024-byte boundary of the dynamic shared memory.
  static constexpr int kSmemBytes =
      (kQElements + 2 * kStages * kTileElements) * kElementBytes + 1024;
  static_assert(kHeadDim % 64 == 0, "column blocks of 64 elements");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

// kSoftcap: the softcap it is compiled for (variant.cuh).
template <typename Traits, typename T, Softcap kSoftcap>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    paged_prefill_wgmma_kernel(const __grid_constant__ PagedKernelArgs args) {
#if defined(ASTRAI_HAS_WGMMA)
  constexpr int D = Traits::kHeadDim;
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kBlockRows = Traits::kBlockRows;
  constexpr float kNegInf = -INFINITY;

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
  T* q_smem = reinterpret_cast<T*>(smem);
  T* k_smem = q_smem + Traits::kQElements;
  T* v_smem = k_smem + kStages * Traits::kTileElements;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int warpgroup = warp / 4;
  const int seq_index = blockIdx.x / p.num_kv_heads;
  const int kv_head = blockIdx.x % p.num_kv_heads;
  const int row_tile = gridDim.y - 1 - blockIdx.y;  // heavy (late, causal) row tiles first

  const SequenceRows seq = prefill_sequence(p, args.query_start_loc, seq_index, args.max_query_len);
  const int group = seq.group;
  const int num_rows = seq.num_rows;
  const int q_start = seq.q_start;
  const int row0 = row_tile * kBlockRows;
  if (row0 >= num_rows) return;

  // Tiles from the one holding the first visible position to the range's end.
  const KvRange range = block_kv_range(p, seq, row0, kBlockRows);
  const UnmaskedTiles unmasked = unmasked_tiles(p, seq, range, row0, kBlockRows);
  const int kv_begin = range.begin / kTileN * kTileN;
  const int num_tiles = range.end > kv_begin ? (range.end - kv_begin + kTileN - 1) / kTileN : 0;

  // ---- global -> shared copies -------------------------------------------------------------
  const KVTileSource source =
      kv_tile_source<T>(p, seq_index, kv_head, kv_begin, range.end, kTileN, range.end);
  KVTileLoader<Traits, T> loader(source, k_smem, v_smem, tid);
  loader.prescan_page_ids();  // once per block: the copies then only clamp their ids

  // ---- per-thread state: rows 16 * warp + lane / 4 (+ 8) of the block -------------------------
  const int lane_row = lane / 4;
  const int lane_col = (lane % 4) * 2;
  float o_acc[D / 2];  // register 4 dt + e: column 8 dt + lane_col + e % 2 of row half e / 2
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o_acc[i] = 0.f;
  float row_max[2] = {kNegInf, kNegInf};
  float row_sum[2] = {0.f, 0.f};

  // Q, committed with the first K/V step.
  load_query_rows<T, kBlockRows, kChunks, kThreads>(
      p, q_smem, tid, q_start, row0, num_rows, group, kv_head,
      [](int r, int ch) { return swizzled_128b_tile_offset<kBlockRows>(r, ch); });
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) {
      loader.lookup(s);
      loader.issue(s, s);
    }
    loader.commit();
  }

  const ScoreTransform transform = score_transform<kSoftcap>(p, args.scale_log2);
  // This warpgroup's 64 rows of the Q tile: 64 rows x 128 bytes into each column block.
  const uint32_t q_rows = shared_address(q_smem) + warpgroup * 64 * 128;

  // The K tile of a stage, for S = Q K^T (wgmma_row_tile.cuh).
  auto k_tile = [&](int stage) { return shared_address(k_smem + stage * Traits::kTileElements); };

  // Software pipeline: the scores of tile t + 1 are multiplied while the softmax of tile t runs
  // (tensor cores and the other units at once), then O += P V of tile t. Stages: tile t + 1 was
  // copied an iteration ahead; tile t + 2 is issued once every thread is past tile t - 1.
  float s_acc[kTileN / 2];
  if (num_tiles > 0) {
    cp_async_wait<kStages - 2>();  // Q and tile 0
    fence_shared_for_async_proxy();
    __syncthreads();
    issue_scores<T, D, kTileN, kBlockRows>(s_acc, q_rows, k_tile(0));
    wgmma_wait<0>();
    pin_registers(s_acc);
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    const bool has_next = tile + 1 < num_tiles;  // the same for every thread of the block
    float s_next[kTileN / 2];
    if (has_next) {
      cp_async_wait<kStages - 3>();  // tile + 1 (issued an iteration ago) has landed
      fence_shared_for_async_proxy();
      __syncthreads();  // ... for every thread, and every thread is done with tile - 1
      const int ahead = tile + kStages - 1;
      if (ahead < num_tiles) {
        loader.lookup(ahead);
        loader.issue(ahead, ahead % kStages);
      }
      loader.commit();
      issue_scores<T, D, kTileN, kBlockRows>(s_next, q_rows, k_tile((tile + 1) % kStages));
    }

    const int pos0 = kv_begin + tile * kTileN;
    constexpr bool kFixedMax = kSoftcap == Softcap::kFixedMax;
    float alpha[2];
    softmax_tile<kTileN, kSoftcap>(s_acc, p, seq, range, unmasked, transform,
                                   row0 + warp * 16 + lane_row, lane_col, pos0, row_max, row_sum,
                                   alpha);
    if constexpr (!kFixedMax) {
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o_acc[i] *= alpha[(i % 4) / 2];
    }

    // O += P V.
    uint32_t p_frag[kTileN / 16][4];
    scores_to_a_fragments<T, kTileN>(s_acc, p_frag);
    const uint32_t v_tile = shared_address(v_smem + (tile % kStages) * Traits::kTileElements);
    pin_registers(o_acc);
    issue_output_update<T, D, kTileN>(o_acc, p_frag, v_tile);
    wgmma_wait<0>();  // the next tile's scores and this tile's P V
    pin_registers(o_acc);
#pragma unroll
    for (int kk = 0; kk < kTileN / 16; ++kk) pin_registers(p_frag[kk]);
    if (has_next) {
      pin_registers(s_next);
#pragma unroll
      for (int i = 0; i < kTileN / 2; ++i) s_acc[i] = s_next[i];
    }
  }
  cp_async_wait<0>();

  sum_rows_over_quad(row_sum);
  // Every warpgroup read every tile: a page outside the pool poisons all of the block's rows.
  const bool poisoned = __syncthreads_or(loader.poisoned) || seq.poisoned;
  store_finished_rows<T, D>(p, seq, kv_head, row0 + warp * 16 + lane_row, lane_col, o_acc, row_max,
                            row_sum, transform, poisoned);
#else
  __trap();  // built without sm_90a: the plan never chooses this (plan_paged_prefill)
#endif
}

template <int D, typename T, typename KV>
LaunchStatus run_paged_prefill_wgmma(const PagedKernelArgs& args, cudaStream_t stream) {
  using Traits = PrefillWgmmaTraits<D>;
  return launch_prefill_row_tiles<T>(args, paged_prefill_wgmma_kernel<Traits, T, Softcap::kOff>,
                                     paged_prefill_wgmma_kernel<Traits, T, Softcap::kRunningMax>,
                                     paged_prefill_wgmma_kernel<Traits, T, Softcap::kFixedMax>,
                                     Traits::kSmemBytes, Traits::kThreads, Traits::kBlockRows,
                                     stream, "paged_prefill_wgmma_kernel");
}

}  // namespace astrai::kernels
