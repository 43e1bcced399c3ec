// Paged prefill on Hopper's warpgroup multiply (wgmma, sm_90a) and its launcher. The plan picks it
// over prefill_mma_sync_kernel.cuh's mma.sync prefill on sm_90 when the library was built for
// sm_90a and the head dim compiles it (config.h, plan.h).
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
// O; with 96-wide kv tiles they fit in 254 registers without spills (128-wide spilled and ran
// slower: benchmarks/results/decisions.md, "Prefill: the first wgmma kernel").
//
// An FP8 cache (KV a byte) is read as it is stored: the copies bring the tile's bytes into
// kStages stages of their own, and after the barrier the block converts them into f16 tiles in
// wgmma's layout (fp8_tile_to_f16: exact, every e4m3 and e5m2 value is an f16), two slots each of
// K and V. Both products then run in f16, as the FP8 decode's do (tile_math.cuh): a bf16 query
// tile becomes f16 once, scaled into f16's range by a power of two (query_tile_to_f16), P is
// packed as f16, the k scale and that power of two fold into the score scale and the v scale
// into each output row. The conversions of iteration t (K of tile t + 2, V of tile t + 1) run
// while the tensor cores multiply P V of tile t, and the next iteration's barrier publishes them;
// the copies of tile t + 3 are in flight for one iteration, as the 16-bit tiles' are. Every block
// converts each tile it reads, so this runs at about 0.9x the 16-bit speed; the plan runs it only
// where dequantizing the pages first (dequantize_pages.cu) would take too much scratch memory
// (plan.h: prefill_dequantizes_fp8_first; decisions.md, "FP8 prefill").
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "../common/wgmma_primitives.cuh"
#include "instantiations.h"
#include "kv_tile_loader.cuh"
#include "params.h"
#include "query_rows.cuh"
#include "variant.cuh"
#include "wgmma_row_tile.cuh"

namespace astr::kernels {

// kKVBytes_: the cache's element size, 2 (q's 16-bit type) or 1 (FP8, converted in shared memory).
template <int kHeadDim_, int kKVBytes_ = 2>
struct PrefillWgmmaTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kDecode = false;
  static constexpr int kWarpGroups = 2;
  static constexpr int kThreads = kWarpGroups * 128;
  static constexpr int kGroups = 1;  // the K/V loader's barriers span the whole block
  static constexpr int kBlockRows = kWarpGroups * 64;  // 64 rows per warpgroup (wgmma's M)
  // Rows of whole 64-element column blocks (128 bytes, the swizzle's): D = 96 leaves half of its
  // second block unused, and the multiplies never read it (k steps of 16, N = D).
  static constexpr int kPaddedHeadDim = (kHeadDim + 63) / 64 * 64;
  // kv positions per tile (S's N), see top; D = 64 multiplies half as much per tile, so it takes
  // wider tiles to carry each tile's fixed work (the barrier, the copies' issue). D = 96: 12
  // chunks a row, so the 256 threads copy tiles of a multiple of 64 rows; 128-wide ones ran faster
  // than 64-wide despite 52-72 bytes of spills.
  static constexpr int kTileN = kHeadDim == 64 || kHeadDim == 96 ? 128 : 96;
  // 16-bit tiles: tile t in use, t + 1 landed, t + 2 in flight. FP8 bytes: V of tile t + 1 and
  // tile t + 2 being converted, t + 3 in flight.
  static constexpr int kStages = 3;
  static constexpr int kElementBytes = 2;  // q's, and the tiles' the multiplies read
  static constexpr int kChunksPerRow = kHeadDim * kElementBytes / 16;
  static constexpr int kKVBytes = kKVBytes_;
  static constexpr bool kFp8 = kKVBytes == 1;
  static_assert(kKVBytes == 1 || kKVBytes == 2, "a 16-bit or an FP8 cache");
  static constexpr int kKVChunksPerRow = kHeadDim * kKVBytes / 16;
  // The loader's layout: 16-bit tiles straight into wgmma's (swizzled_128b_tile_offset); FP8
  // bytes in rows of D bytes with their 16-byte chunks swizzled (tile_offset), which
  // fp8_tile_to_f16 reads.
  static constexpr bool kWgmmaTiles = !kFp8;
  static constexpr bool kKVSwizzle = true;
  static constexpr int kKVChunkElements = 16 / kKVBytes;
  static constexpr bool kPageIdRing = false;  // page ids into registers (kv_tile_loader.cuh)
  static constexpr int kPageIdSlots = 0;
  // A stage, in the cache's elements (FP8 bytes in rows of D), and a tile the multiplies read.
  static constexpr int kTileElements = kTileN * (kFp8 ? kHeadDim : kPaddedHeadDim);
  static constexpr int kMultipliedTileElements = kTileN * kPaddedHeadDim;
  static constexpr int kQElements = kBlockRows * kPaddedHeadDim;
  static constexpr int kConvertedSlots = kFp8 ? 2 : 0;  // f16 tiles of K (and of V) from FP8
  // + 1024: the tiles start on the first 1024-byte boundary of the dynamic shared memory.
  static constexpr int kSmemBytes =
      kQElements * kElementBytes + 2 * kStages * kTileElements * kKVBytes +
      2 * kConvertedSlots * kMultipliedTileElements * kElementBytes + 1024;
  static_assert(kHeadDim % 32 == 0, "k steps of 16 in whole halves of column blocks");
  static_assert(!kFp8 || kHeadDim % 128 == 0, "FP8 rows of whole 128-byte swizzle rows");
  static_assert((kTileElements * kKVBytes) % 1024 == 0, "stages on 1024-byte boundaries");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

// kSoftcap: the softcap it is compiled for (variant.cuh); kE5M2: an FP8 cache holds e5m2 (else
// e4m3).
template <typename Traits, typename T, typename KV, Softcap kSoftcap, bool kE5M2>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    paged_prefill_wgmma_kernel(const __grid_constant__ PagedKernelArgs args) {
#if defined(ASTR_HAS_WGMMA)
  static_assert(sizeof(KV) == Traits::kKVBytes, "traits of this cache");
  allow_dependent_launch();  // the unplaced-rows check (query_rows.cuh) runs beside it
  constexpr bool kFp8 = Traits::kFp8;
  // The multiplies' operand type: q's, or f16 over an FP8 cache (see top).
  using M = std::conditional_t<kFp8, __half, T>;
  constexpr int D = Traits::kHeadDim;
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kBlockRows = Traits::kBlockRows;
  // Tiles whose copies start before the loop: the 16-bit tiles' kStages - 1, FP8 a stage more
  // (each tile's bytes are converted an iteration before the multiplies read them).
  constexpr int kAhead = kFp8 ? kStages : kStages - 1;
  constexpr float kNegInf = -INFINITY;

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
  M* q_smem = reinterpret_cast<M*>(smem);  // copied as T, f16 from then on over an FP8 cache
  KV* k_smem = reinterpret_cast<KV*>(smem + Traits::kQElements * Traits::kElementBytes);
  KV* v_smem = k_smem + kStages * Traits::kTileElements;
  M* k_converted = reinterpret_cast<M*>(v_smem + kStages * Traits::kTileElements);  // FP8
  M* v_converted = k_converted + Traits::kConvertedSlots * Traits::kMultipliedTileElements;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int warpgroup = warp / 4;
  const PrefillBlock block = prefill_block_coordinates(p.num_kv_heads, args.panel_pairs);
  const int seq_index = block.seq_index;
  const int kv_head = block.kv_head;
  const int row_tile = block.row_tile;

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
      kv_tile_source<KV>(p, seq_index, kv_head, kv_begin, range.end, kTileN, range.end);
  KVTileLoader<Traits, KV> loader(source, k_smem, v_smem, tid);
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
  auto q_offset = [](int r, int ch) { return swizzled_128b_tile_offset<kBlockRows>(r, ch); };
  load_query_rows<T, kBlockRows, kChunks, kThreads>(p, reinterpret_cast<T*>(q_smem), tid, q_start,
                                                    row0, num_rows, group, kv_head, q_offset);
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < num_tiles) {
      loader.lookup(s);
      loader.issue(s, s);
    }
    loader.commit();
  }

  // The tiles the multiplies read (wgmma_row_tile.cuh): the stages themselves, or over an FP8
  // cache the converted slots (tile t in slot t % 2).
  auto k_tile = [&](int tile) -> uint32_t {
    if constexpr (kFp8)
      return shared_address(k_converted + (tile % 2) * Traits::kMultipliedTileElements);
    else
      return shared_address(k_smem + (tile % kStages) * Traits::kTileElements);
  };
  auto v_tile = [&](int tile) -> uint32_t {
    if constexpr (kFp8)
      return shared_address(v_converted + (tile % 2) * Traits::kMultipliedTileElements);
    else
      return shared_address(v_smem + (tile % kStages) * Traits::kTileElements);
  };
  // FP8: the landed bytes of a tile's K (kV false) or V into its converted slot.
  auto convert = [&](int tile, bool kV) {
    if constexpr (kFp8) {
      const KV* staged = (kV ? v_smem : k_smem) + (tile % kStages) * Traits::kTileElements;
      M* slot = (kV ? v_converted : k_converted) + (tile % 2) * Traits::kMultipliedTileElements;
      fp8_tile_to_f16<D, kTileN, kThreads, kE5M2>(staged, slot, tid);
    }
  };

  // FP8: the kv head's k scale folds into the score scale, its v scale into each output row;
  // a bf16 query scaled into f16's range adds its power of two to the score scale.
  const KvScales scales = kv_head_scales<kFp8>(p, kv_head);
  ScoreTransform transform = score_transform<kSoftcap>(p, args.scale_log2 * scales.k);
  // This warpgroup's 64 rows of the Q tile: 64 rows x 128 bytes into each column block.
  const uint32_t q_rows = shared_address(q_smem) + warpgroup * 64 * 128;

  // Software pipeline: the scores of tile t + 1 are multiplied while the softmax of tile t runs
  // (tensor cores and the other units at once), then O += P V of tile t. Stages: tile t + 1 was
  // copied an iteration ahead; tile t + 2 is issued once every thread is past tile t - 1.
  float s_acc[kTileN / 2];
  if (num_tiles > 0) {
    cp_async_wait<kStages - 2>();  // Q and tile 0 (FP8: and tile 1)
    if constexpr (kFp8) {
      __syncthreads();
      if constexpr (!std::is_same_v<T, __half>) {
        __shared__ float warp_largest[kThreads / 32];
        const float q_restore = query_tile_to_f16<kBlockRows, kChunks, kThreads>(
            q_smem, tid, q_offset, [] { __syncthreads(); }, warp_largest);
        transform = score_transform<kSoftcap>(p, args.scale_log2 * scales.k * q_restore);
      }
      convert(0, false);
      convert(0, true);
      if (num_tiles > 1) convert(1, false);
    }
    fence_shared_for_async_proxy();
    __syncthreads();
    issue_scores<M, D, kTileN, kBlockRows>(s_acc, q_rows, k_tile(0));
    wgmma_wait<0>();
    pin_registers(s_acc);
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    const bool has_next = tile + 1 < num_tiles;  // the same for every thread of the block
    float s_next[kTileN / 2];
    // FP8: V of this tile was converted in the last iteration, so every iteration waits.
    if (kFp8 || has_next) {
      // The tile issued an iteration ago has landed (16-bit: tile + 1; FP8: tile + 2) ...
      cp_async_wait<kFp8 ? 0 : kStages - 3>();
      fence_shared_for_async_proxy();
      __syncthreads();  // ... for every thread, and every thread is done with tile - 1
    }
    if (has_next) {
      const int ahead = tile + kAhead;
      if (ahead < num_tiles) {
        loader.lookup(ahead);
        loader.issue(ahead, ahead % kStages);
      }
      loader.commit();
      issue_scores<M, D, kTileN, kBlockRows>(s_next, q_rows, k_tile(tile + 1));
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
    scores_to_a_fragments<M, kTileN>(s_acc, p_frag);
    const uint32_t v_rows = v_tile(tile);
    pin_registers(o_acc);
    issue_output_update<M, D, kTileN>(o_acc, p_frag, v_rows);
    if constexpr (kFp8) {
      // Under the multiplies (other slots than theirs); the next iteration's barrier publishes
      // them. Before the softmax they delayed it (decisions.md, "FP8 prefill in the wgmma kernel").
      if (tile + 2 < num_tiles) convert(tile + 2, false);
      if (has_next) convert(tile + 1, true);
    }
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
                            row_sum, transform, poisoned, scales.v);
#else
  __trap();  // built without sm_90a: the plan never chooses this (plan_paged_prefill)
#endif
}

template <int D, typename T, typename KV>
LaunchStatus run_paged_prefill_wgmma(const PagedKernelArgs& args, cudaStream_t stream) {
  if constexpr (sizeof(KV) == 1 && !prefill_reads_fp8(PrefillKernel::kWgmma, D)) {
    return {"prefill: the wgmma kernel reads FP8 pages at head dims of whole 128-byte rows only"};
  } else {
    using Traits = PrefillWgmmaTraits<D, sizeof(KV)>;
    return launch_prefill<T, Traits::kFp8>(
        args,
        [](auto softcap, auto e5m2) {
          return paged_prefill_wgmma_kernel<Traits, T, KV, decltype(softcap)::value,
                                            decltype(e5m2)::value>;
        },
        Traits::kSmemBytes, Traits::kThreads, Traits::kBlockRows, stream,
        "paged_prefill_wgmma_kernel");
  }
}

}  // namespace astr::kernels
