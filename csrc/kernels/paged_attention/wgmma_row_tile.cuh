// What a warpgroup that owns 64 packed query rows does with each kv tile on Hopper's warpgroup
// multiply, shared by the two wgmma prefills (prefill_wgmma_kernel.cuh, where every warp also
// copies, and prefill_warp_specialized_kernel.cuh, where a producer warpgroup does): issue
// S = Q K^T, turn the landed scores into weights (variant layer, online softmax), pack them as the
// A operand of O += P V, issue that, and store the finished rows; and, over an FP8 cache, turn a
// staged tile's bytes into the f16 tile the multiplies read (fp8_tile_to_f16).
//
// Layouts: Q, K and V tiles in shared memory as swizzled_128b_tile_offset lays them out (column
// blocks of 64 elements, each R rows x 128 bytes); per thread, rows thread_row and thread_row + 8
// (thread_row = the warpgroup's first row + 16 (warp % 4) + lane / 4) and, in every n8 block,
// columns lane_col and lane_col + 1 (lane_col = 2 (lane % 4)): wgmma_primitives.cuh has the
// accumulator layout.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "../common/device_primitives.cuh"
#include "../common/online_softmax.cuh"
#include "../common/wgmma_primitives.cuh"
#include "params.h"
#include "variant.cuh"

namespace astr::kernels {

#if defined(ASTR_HAS_WGMMA)
// S = Q K^T of one tile into s, issued (committed as one wgmma group), not waited for. q_rows: the
// warpgroup's first Q row in a Q tile of kBlockRows rows; k_tile: the K tile of kTileN rows.
template <typename T, int D, int kTileN, int kBlockRows>
__device__ __forceinline__ void issue_scores(float (&s)[kTileN / 2], uint32_t q_rows,
                                             uint32_t k_tile) {
  const uint64_t q_first = swizzled_descriptor(q_rows, 16, 1024);
  const uint64_t k_first = swizzled_descriptor(k_tile, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint32_t k_bytes = (ks % 4) * 32;  // k16 slice inside the 128-byte rows
    const uint64_t desc_q = advance_descriptor(q_first, (ks / 4) * kBlockRows * 128 + k_bytes);
    const uint64_t desc_k = advance_descriptor(k_first, (ks / 4) * kTileN * 128 + k_bytes);
    WgmmaM64<T, kTileN>::both_from_shared(s, desc_q, desc_k, ks > 0 ? 1 : 0);
  }
  wgmma_commit();
}

// O += P V of one tile (P from scores_to_a_fragments, V the tile of kTileN rows), issued, not
// waited for.
template <typename T, int D, int kTileN>
__device__ __forceinline__ void issue_output_update(float (&o)[D / 2],
                                                    const uint32_t (&p_frag)[kTileN / 16][4],
                                                    uint32_t v_tile) {
  const uint64_t v_first = swizzled_descriptor(v_tile, kTileN * 128, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTileN / 16; ++kk) {
    // k = kv rows 16 kk .. 16 kk + 15: two 8-row atoms; n = d across the column blocks.
    const uint64_t desc_v = advance_descriptor(v_first, kk * 16 * 128);
    WgmmaM64<T, D>::a_from_registers(o, p_frag[kk], desc_v, 1);
  }
  wgmma_commit();
}
#endif

// The landed scores of the tile at kv position pos0 -> their exp2 weights: the variant layer's
// score transform and mask, then the online softmax of this thread's two rows. alpha: the factor
// each row's output must be rescaled by (1 with the fixed max). seen(half): the RowVisibility of
// row thread_row + 8 half (row_visibility), asked only for tiles that need the mask.
template <int kTileN, Softcap kSoftcap, typename Seen>
__device__ __forceinline__ void softmax_tile_seen(float (&s)[kTileN / 2],
                                                  const UnmaskedTiles& unmasked,
                                                  const ScoreTransform& transform, Seen&& seen,
                                                  int lane_col, int pos0, float (&row_max)[2],
                                                  float (&row_sum)[2], float (&alpha)[2]) {
  transform_scores<kTileN / 2>(transform, [&](int i) -> float& { return s[i]; });
  if (unmasked.need_mask(pos0, kTileN)) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const RowVisibility row = seen(half);
#pragma unroll
      for (int nt = 0; nt < kTileN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (!visible(row, pos0 + nt * 8 + lane_col + e)) s[nt * 4 + half * 2 + e] = -INFINITY;
        }
      }
    }
  }
  constexpr bool kFixedMax = kSoftcap == Softcap::kFixedMax;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    alpha[half] = online_softmax_row<kTileN / 8, kFixedMax>(
        [&](int nt, int e) -> float& { return s[nt * 4 + half * 2 + e]; }, row_max[half],
        row_sum[half], transform.exp_scale);
  }
}
template <int kTileN, Softcap kSoftcap>
__device__ __forceinline__ void softmax_tile(float (&s)[kTileN / 2], const PagedAttentionParams& p,
                                             const SequenceRows& seq, const KvRange& range,
                                             const UnmaskedTiles& unmasked,
                                             const ScoreTransform& transform, int thread_row,
                                             int lane_col, int pos0, float (&row_max)[2],
                                             float (&row_sum)[2], float (&alpha)[2]) {
  softmax_tile_seen<kTileN, kSoftcap>(
      s, unmasked, transform,
      [&](int half) { return row_visibility(p, seq, range, thread_row + half * 8); }, lane_col,
      pos0, row_max, row_sum, alpha);
}

// The FP8 bytes of a staged K or V tile of kTileN rows (rows of D bytes, 16-byte chunks swizzled:
// tile_offset, as the loader lays them) as an f16 tile in wgmma's layout
// (swizzled_128b_tile_offset), by the block's kThreads threads; exact, as every e4m3 and e5m2 value
// is an f16 (fp8_pair_to_f16x2). Thread i of a pass takes chunk i / kTileN of row i % kTileN, so
// that the 8 threads of a quarter warp (one shared-memory wavefront of 16-byte accesses) read and
// write 8 rows, whose swizzled chunks lie in 8 distinct bank groups.
template <int D, int kTileN, int kThreads, bool kE5M2>
__device__ __forceinline__ void fp8_tile_to_f16(const uint8_t* staged, __half* tile, int tid) {
  constexpr int kChunks = D / 16;  // FP8 chunks of a row
  static_assert((kTileN * kChunks) % kThreads == 0 && kTileN % 8 == 0, "whole passes");
#pragma unroll
  for (int i = 0; i < kTileN * kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int row = c % kTileN;
    const int chunk = c / kTileN;
    const uint4 bytes =
        *reinterpret_cast<const uint4*>(staged + tile_offset<D, true, 16>(row, chunk));
    const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
    uint32_t h[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      h[2 * w] = fp8_pair_to_f16x2<kE5M2, false>(words[w]);
      h[2 * w + 1] = fp8_pair_to_f16x2<kE5M2, true>(words[w]);
    }
    // FP8 chunk c of a row is 16-bit chunks 2c and 2c + 1.
    *reinterpret_cast<uint4*>(tile + swizzled_128b_tile_offset<kTileN>(row, 2 * chunk)) =
        make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(tile + swizzled_128b_tile_offset<kTileN>(row, 2 * chunk + 1)) =
        make_uint4(h[4], h[5], h[6], h[7]);
  }
}

// The weights as 16-bit A fragments of O += P V: two adjacent n8 blocks of S are one k16 step.
template <typename T, int kTileN>
__device__ __forceinline__ void scores_to_a_fragments(const float (&s)[kTileN / 2],
                                                      uint32_t (&p_frag)[kTileN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kTileN / 16; ++kk) {
    p_frag[kk][0] = pack_pair<T>(s[8 * kk + 0], s[8 * kk + 1]);
    p_frag[kk][1] = pack_pair<T>(s[8 * kk + 2], s[8 * kk + 3]);
    p_frag[kk][2] = pack_pair<T>(s[8 * kk + 4], s[8 * kk + 5]);
    p_frag[kk][3] = pack_pair<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// Each row's sum over the quad of lanes that hold its columns (after the last tile).
__device__ __forceinline__ void sum_rows_over_quad(float (&row_sum)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float s = row_sum[half];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    row_sum[half] = s;
  }
}

// The finished rows (sums from sum_rows_over_quad): the variant layer's finish (variant.cuh),
// then this thread's columns of the output, times out_scale (an FP8 cache's v scale), and the
// row's LSE. Rows past num_rows are padding.
template <typename T, int D>
__device__ __forceinline__ void store_finished_rows(
    const PagedAttentionParams& p, const SequenceRows& seq, int kv_head, int thread_row,
    int lane_col, const float (&o)[D / 2], const float (&row_max)[2], const float (&row_sum)[2],
    const ScoreTransform& transform, bool poisoned, float out_scale = 1.f) {
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = thread_row + half * 8;
    if (row >= seq.num_rows) continue;
    const int token = seq.q_start + row / seq.group;
    const int head = kv_head * seq.group + row % seq.group;
    const FinishedRow finished =
        finish_row(row_max[half] * transform.exp_scale, poison_sum(row_sum[half], poisoned),
                   sink_log2(p, head));
    const float inv = finished.inv * out_scale;
    T* dst = out + token * p.out_stride_token + head * p.out_stride_head + lane_col;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<uint32_t*>(dst + dt * 8) =
          pack_pair<T>(o[dt * 4 + half * 2] * inv, o[dt * 4 + half * 2 + 1] * inv);
    if (lane_col == 0) store_lse(p, token, head, finished.lse_log2);
  }
}

}  // namespace astr::kernels
