// Paged prefill on mma.sync (sm_80 and newer; on sm_90 at D = 128 prefill_wgmma_kernel.cuh runs
// instead, plan.h) and its launcher. traits.h has the design.
//
// A block owns kBlockRows packed query rows (new token, q head of the GQA group: variant.cuh) of
// one (sequence, kv head); its warps split the rows, every warp reads the whole K/V tile. Tiles
// outside the rows' visible range (past the causal edge of the block's last token, before the
// window of its first) are never read. Heavy (late, causal) row tiles start first.
//
// An FP8 cache (KV a byte) is read as stored and converted in registers, the products in f16
// (tile_math.cuh): a bf16 query tile becomes f16 once, scaled into f16's range by a power of two
// (query_tile_to_f16), which with the k scale joins the score scale; the v scale multiplies each
// output row. The plan runs it where dequantizing the pages first would take too much scratch
// memory (plan.h: prefill_dequantizes_fp8_first).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "../common/online_softmax.cuh"
#include "instantiations.h"
#include "kv_tile_loader.cuh"
#include "params.h"
#include "query_rows.cuh"
#include "tile_math.cuh"
#include "traits.h"
#include "variant.cuh"

namespace astr::kernels {

// kSoftcap: the softcap it is compiled for (variant.cuh); kE5M2: an FP8 cache holds e5m2 (else
// e4m3).
template <typename Traits, typename T, typename KV, Softcap kSoftcap, bool kE5M2>
__global__ void __launch_bounds__(Traits::kBlockThreads, Traits::kMinBlocksPerSm)
    paged_prefill_kernel(const __grid_constant__ PagedKernelArgs args) {
  static_assert(!Traits::kDecode && Traits::kGroups == 1, "prefill traits");
  allow_dependent_launch();  // the unplaced-rows check (query_rows.cuh) runs beside it
  static_assert(sizeof(KV) == Traits::kKVBytes, "traits of this cache");
  constexpr bool kFp8 = Traits::kFp8;
  constexpr int D = Traits::kHeadDim;    // q and k
  constexpr int DV = Traits::kVColumns;  // the block's chunk of v's (and the output's) columns
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kMRep = Traits::kRowBlocksPerWarp;
  constexpr int kBlockRows = Traits::kBlockRows;

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_smem = reinterpret_cast<T*>(smem_raw);  // f16 once converted, over an FP8 cache
  KV* k_smem = reinterpret_cast<KV*>(q_smem + Traits::kQSmemElements);
  KV* v_smem = k_smem + Traits::kKVSmemElements;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  // The grid's pairs are (sequence, kv head, v column chunk) triples, a pair's chunks side by side.
  const PrefillBlock block =
      prefill_block_coordinates(p.num_kv_heads * Traits::kVChunks, args.panel_pairs);
  const int seq_index = block.seq_index;
  const int kv_head = block.kv_head / Traits::kVChunks;
  const int v_column0 = block.kv_head % Traits::kVChunks * DV;
  const int row_tile = block.row_tile;

  const SequenceRows seq = prefill_sequence(p, args.query_start_loc, seq_index, args.max_query_len);
  const int group = seq.group;
  const int num_rows = seq.num_rows;
  const int row0 = row_tile * kBlockRows;
  if (row0 >= num_rows) return;

  // Tiles from the one holding the first visible position to the range's end.
  const KvRange range = block_kv_range(p, seq, row0, kBlockRows);
  const UnmaskedTiles unmasked = unmasked_tiles(p, seq, range, row0, kBlockRows);
  const int kv_begin = range.begin / kTileN * kTileN;
  const int num_tiles = range.end > kv_begin ? (range.end - kv_begin + kTileN - 1) / kTileN : 0;

  // ---- global -> shared copies -------------------------------------------------------------
  // K/V tiles (see kv_tile_loader.cuh): page ids looked up just before each copy.
  const KVTileSource source =
      kv_tile_source<KV>(p, seq_index, kv_head, kv_begin, range.end, kTileN, range.end, v_column0);
  KVTileLoader<Traits, KV> loader(source, k_smem, v_smem, tid);
  loader.prescan_page_ids();  // once per block: the copies then only clamp their ids

  // ---- per-warp state: kMRep x 16 rows of the block, the whole of every tile ------------------
  const int warp_row0 = warp * 16 * kMRep;
  const int lane_row = lane / 4;        // fragment row (and +8)
  const int lane_col = (lane % 4) * 2;  // fragment column pair

  WarpSoftmaxState<Traits> state;  // O, running max and sum of the warp's rows
  state.reset();

  auto q_offset = [](int r, int ch) { return tile_offset<D, Traits::kSwizzle>(r, ch); };
  auto load_q_fragment = [&](int mi, int ks, uint32_t (&a)[4]) {
    if constexpr (kFp8) {  // the FP8 tiles' k order (tile_math.cuh)
      load_fp8_query_fragment(q_smem, warp_row0 + mi * 16, lane, ks, q_offset, a);
    } else {
      const int r = warp_row0 + mi * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
      const int ch = ks * 2 + lane / 16;
      ldmatrix_x4(shared_address(q_smem + q_offset(r, ch)), a);
    }
  };

  // ---- pipeline prologue: the query with the first K/V step (compute-bound: no registers to
  // spare for looking page ids up ahead, so each lookup comes just before its copy) -----------
  load_query_rows<T, kBlockRows, kChunks, kThreads>(p, q_smem, tid, seq.q_start, row0, num_rows,
                                                    group, kv_head, q_offset);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) {
      loader.lookup(s);
      loader.issue(s, s);
    }
    loader.commit();  // one step per stage, empty or not, keeps the wait counts uniform
  }

  // FP8: the kv head's k scale folds into the score scale, its v scale into each output row.
  const KvScales scales = kv_head_scales<kFp8>(p, kv_head);
  ScoreTransform transform = score_transform<kSoftcap>(p, args.scale_log2 * scales.k);

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int next = tile + kStages - 1;
    if (next < num_tiles) {
      loader.lookup(next);
      loader.issue(next, next % kStages);
    }
    loader.commit();
    loader.wait();
    // FP8 tiles are multiplied in f16: a bf16 query becomes f16 once it has landed.
    if constexpr (kFp8 && !std::is_same_v<T, __half>) {
      if (tile == 0) {
        __shared__ float warp_largest[kThreads / 32];
        const float restore = query_tile_to_f16<kBlockRows, kChunks, kThreads>(
            q_smem, tid, q_offset, [] { __syncthreads(); }, warp_largest);
        transform = score_transform<kSoftcap>(p, args.scale_log2 * scales.k * restore);
      }
    }

    const int stage = tile % kStages;
    const KV* k_tile = k_smem + stage * Traits::kTileElements;
    const KV* v_tile = v_smem + stage * Traits::kVTileElements;
    const int pos0 = kv_begin + tile * kTileN;

    attend_kv_tile<Traits, T, KV, kE5M2, kSoftcap == Softcap::kFixedMax>(
        k_tile, v_tile, 0, lane,
        [&](int mi, int ks, uint32_t (&a)[4]) { load_q_fragment(mi, ks, a); },
        [&] { return unmasked.need_mask(pos0, kTileN); },
        [&](auto& s_acc) {
          mask_invisible_scores<Traits>(s_acc, p, seq, range, lane, row0 + warp_row0, pos0);
        },
        transform, state);
    __syncthreads();  // the next iteration's copy overwrites this stage
  }
  cp_async_wait<0>();
  // From here on row_max is in the log2 domain, row_sum the full row's.
  finish_row_states(state, transform.exp_scale);
  // Every warp read every tile: a page outside the pool poisons all of the block's rows.
  const bool poisoned = __syncthreads_or(loader.poisoned) || seq.poisoned;

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int mi = 0; mi < kMRep; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + warp_row0 + mi * 16 + lane_row + half * 8;
      if (row >= num_rows) continue;
      const int token = seq.q_start + row / group;
      const int head = kv_head * group + row % group;
      const FinishedRow finished =
          finish_row(state.row_max[mi][half], poison_sum(state.row_sum[mi][half], poisoned),
                     sink_log2(p, head));
      const float inv = finished.inv * scales.v;
      T* dst = out + token * p.out_stride_token + head * p.out_stride_head + v_column0;
      const float (&o)[DV / 8][4] = state.o[mi];
      if constexpr (kFp8) {
        // Blocks 2 j and 2 j + 1 hold d = 16 j + 4 t .. + 3 of this lane (fp8_output_column).
#pragma unroll
        for (int j = 0; j < DV / 16; ++j)
          *reinterpret_cast<uint2*>(dst + 16 * j + 2 * lane_col) = make_uint2(
              pack_pair<T>(o[2 * j][half * 2] * inv, o[2 * j + 1][half * 2] * inv),
              pack_pair<T>(o[2 * j][half * 2 + 1] * inv, o[2 * j + 1][half * 2 + 1] * inv));
      } else {
#pragma unroll
        for (int dt = 0; dt < DV / 8; ++dt) {
          *reinterpret_cast<uint32_t*>(dst + lane_col + dt * 8) =
              pack_pair<T>(o[dt][half * 2] * inv, o[dt][half * 2 + 1] * inv);
        }
      }
      // Every chunk's statistics are the same: chunk 0 writes the lse.
      if (lane_col == 0 && v_column0 == 0) store_lse(p, token, head, finished.lse_log2);
    }
  }
}

template <int D, int DV, typename T, typename KV>
LaunchStatus run_paged_prefill(const PagedKernelArgs& args, cudaStream_t stream) {
  using Traits = PrefillTraits<D, sizeof(KV), DV>;
  return launch_prefill<T, Traits::kFp8, Traits::kVChunks>(
      args,
      [](auto softcap, auto e5m2) {
        return paged_prefill_kernel<Traits, T, KV, decltype(softcap)::value, decltype(e5m2)::value>;
      },
      Traits::kBlockSmemBytes, Traits::kBlockThreads, Traits::kBlockRows, stream,
      "paged_prefill_kernel");
}

}  // namespace astr::kernels
