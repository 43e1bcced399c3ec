// Paged prefill on mma.sync (sm_80 and newer; on sm_90 at D = 128 prefill_wgmma_kernel.cuh runs
// instead, plan.h) and its launcher. traits.h has the design.
//
// A block owns kBlockRows packed query rows (new token, q head of the GQA group: variant.cuh) of
// one (sequence, kv head); its warps split the rows, every warp reads the whole K/V tile. Tiles
// outside the rows' visible range (past the causal edge of the block's last token, before the
// window of its first) are never read. Heavy (late, causal) row tiles start first.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

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

namespace astrai::kernels {

// kSoftcap: the softcap it is compiled for (variant.cuh).
template <typename Traits, typename T, Softcap kSoftcap>
__global__ void __launch_bounds__(Traits::kBlockThreads, Traits::kMinBlocksPerSm)
    paged_prefill_kernel(const __grid_constant__ PagedKernelArgs args) {
  static_assert(!Traits::kDecode && Traits::kGroups == 1, "prefill traits");
  constexpr int D = Traits::kHeadDim;
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kMRep = Traits::kRowBlocksPerWarp;
  constexpr int kBlockRows = Traits::kBlockRows;

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_smem = reinterpret_cast<T*>(smem_raw);
  T* k_smem = q_smem + Traits::kQSmemElements;
  T* v_smem = k_smem + Traits::kKVSmemElements;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int seq_index = blockIdx.x / p.num_kv_heads;
  const int kv_head = blockIdx.x % p.num_kv_heads;
  const int row_tile = gridDim.y - 1 - blockIdx.y;  // heavy (late, causal) row tiles first

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
      kv_tile_source<T>(p, seq_index, kv_head, kv_begin, range.end, kTileN, range.end);
  KVTileLoader<Traits, T> loader(source, k_smem, v_smem, tid);
  loader.prescan_page_ids();  // once per block: the copies then only clamp their ids

  // ---- per-warp state: kMRep x 16 rows of the block, the whole of every tile ------------------
  const int warp_row0 = warp * 16 * kMRep;
  const int lane_row = lane / 4;        // fragment row (and +8)
  const int lane_col = (lane % 4) * 2;  // fragment column pair

  WarpSoftmaxState<Traits> state;  // O, running max and sum of the warp's rows
  state.reset();

  auto load_q_fragment = [&](int mi, int ks, uint32_t (&a)[4]) {
    const int r = warp_row0 + mi * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    const int ch = ks * 2 + lane / 16;
    ldmatrix_x4(shared_address(q_smem + tile_offset<D, Traits::kSwizzle>(r, ch)), a);
  };

  // ---- pipeline prologue: the query with the first K/V step (compute-bound: no registers to
  // spare for looking page ids up ahead, so each lookup comes just before its copy) -----------
  load_query_rows<T, kBlockRows, kChunks, kThreads>(
      p, q_smem, tid, seq.q_start, row0, num_rows, group, kv_head,
      [](int r, int ch) { return tile_offset<D, Traits::kSwizzle>(r, ch); });
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) {
      loader.lookup(s);
      loader.issue(s, s);
    }
    loader.commit();  // one step per stage, empty or not, keeps the wait counts uniform
  }

  const ScoreTransform transform = score_transform<kSoftcap>(p, args.scale_log2);

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int next = tile + kStages - 1;
    if (next < num_tiles) {
      loader.lookup(next);
      loader.issue(next, next % kStages);
    }
    loader.commit();
    loader.wait();

    const int stage = tile % kStages;
    const T* k_tile = k_smem + stage * Traits::kTileElements;
    const T* v_tile = v_smem + stage * Traits::kTileElements;
    const int pos0 = kv_begin + tile * kTileN;

    attend_kv_tile<Traits, T, T, /*kE5M2=*/false, kSoftcap == Softcap::kFixedMax>(
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
      const float inv = finished.inv;
      T* dst = out + token * p.out_stride_token + head * p.out_stride_head + lane_col;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(dst + dt * 8) =
            pack_pair<T>(state.o[mi][dt][half * 2] * inv, state.o[mi][dt][half * 2 + 1] * inv);
      }
      if (lane_col == 0) store_lse(p, token, head, finished.lse_log2);
    }
  }
}

template <int D, typename T, typename KV>
LaunchStatus run_paged_prefill(const PagedKernelArgs& args, cudaStream_t stream) {
  using Traits = PrefillTraits<D>;
  return launch_prefill_row_tiles<T>(args, paged_prefill_kernel<Traits, T, Softcap::kOff>,
                                     paged_prefill_kernel<Traits, T, Softcap::kRunningMax>,
                                     paged_prefill_kernel<Traits, T, Softcap::kFixedMax>,
                                     Traits::kBlockSmemBytes, Traits::kBlockThreads,
                                     Traits::kBlockRows, stream, "paged_prefill_kernel");
}

}  // namespace astrai::kernels
