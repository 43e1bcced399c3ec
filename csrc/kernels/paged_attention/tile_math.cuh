// A warp's work on one K/V tile in shared memory, and the decode's merge of its warps' softmax
// states: shared by the mma.sync kernels (decode_kernel.cuh, decode_persistent_kernel.cuh,
// prefill_mma_sync_kernel.cuh).
//
// attend_kv_tile: S = Q K^T for the warp's rows x Traits::kWarpTileN kv positions of the tile
// (starting at warp_col0 inside it), the score transform (variant.cuh), the caller's mask, the
// online softmax step and O += P V, on mma.sync.m16n8k16 with fp32 accumulators
// (FlashAttention-2). Q and K rows are Traits::kHeadDim long, V's tile the block's
// Traits::kVColumns (a chunk of v's columns: traits.h).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/device_primitives.cuh"
#include "../common/online_softmax.cuh"
#include "params.h"
#include "variant.cuh"

namespace astr::kernels {

// The running softmax state of a warp's rows: O (unnormalized; the block's kVColumns of v's
// columns), the running max of the scores (unscaled when the scale is folded) and this lane's
// running sum of exp2.
template <typename Traits>
struct WarpSoftmaxState {
  static constexpr int kMRep = Traits::kRowBlocksPerWarp;
  float o[kMRep][Traits::kVColumns / 8][4];
  float row_max[kMRep][2];
  float row_sum[kMRep][2];

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int mi = 0; mi < kMRep; ++mi) {
#pragma unroll
      for (int dt = 0; dt < Traits::kVColumns / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mi][dt][e] = 0.f;
      row_max[mi][0] = row_max[mi][1] = -INFINITY;
      row_sum[mi][0] = row_sum[mi][1] = 0.f;
    }
  }
};

// kFixedMax: the softmax keeps its max at 0 (online_softmax.cuh; a prefill compiled for
// Softcap::kFixedMax, variant.cuh).
// q_fragment(mi, ks, a) fills the A fragment of row block mi, k-step ks; mask_scores(s) sets the
// scores the rows may not see to -inf, called only where needs_mask() says the tile has any
// (asked after S, which keeps its operands out of registers during the multiplies). The scores
// are transformed (scale, softcap: variant.cuh's ScoreTransform) before the mask.
//
// FP8 tiles (KV a byte, Traits::kFp8; kE5M2: the bytes are e5m2, else e4m3): K and V
// are converted to f16 in registers (fp8_pair_to_f16x2) and both products run in f16, whatever
// q's type: the query tile is f16 by then (query_tile_to_f16) and P is packed as f16 (it lies in
// [0, 1]: the running max, never the fixed one). An ldmatrix of FP8 rows read as 16-bit pairs gives
// a thread 4 consecutive bytes of a K row, d = 4t .. 4t + 3 of a 16-byte chunk: they are the k16
// step's B fragment if the step's k index 2t, 2t + 1 stands for d = 4t, 4t + 1 and 2t + 8, 2t + 9
// for 4t + 2, 4t + 3; the query fragments (q_fragment) follow the same order
// (load_fp8_query_fragment). For V the transposed ldmatrix gives bytes of two rows at d = 2g, 2g +
// 1: the even d of a chunk make one n8 block of the output and the odd ones another, so O holds the
// chunk's columns in the order fp8_output_column says (merge_warp_states and the prefill's
// store write them by it). The converted K and V fragments serve every row block of the warp.
template <typename Traits, typename T, typename KV, bool kE5M2 = false, bool kFixedMax = false,
          typename QFragment, typename NeedsMask, typename MaskScores>
__device__ __forceinline__ void attend_kv_tile(const KV* k_tile, const KV* v_tile, int warp_col0,
                                               int lane, QFragment&& q_fragment,
                                               NeedsMask&& needs_mask, MaskScores&& mask_scores,
                                               const ScoreTransform& transform,
                                               WarpSoftmaxState<Traits>& state) {
  constexpr int D = Traits::kHeadDim;
  constexpr int DV = Traits::kVColumns;
  constexpr int kMRep = Traits::kRowBlocksPerWarp;
  constexpr int kWarpTileN = Traits::kWarpTileN;
  constexpr bool kSwizzle = Traits::kKVSwizzle;
  constexpr bool kVSwizzle = Traits::kVSwizzle;
  constexpr int kChunkElements = Traits::kKVChunkElements;
  using P = std::conditional_t<Traits::kFp8, __half, T>;  // P's type in the P V multiply

  float s_acc[kMRep][kWarpTileN / 8][4];
#pragma unroll
  for (int mi = 0; mi < kMRep; ++mi)
#pragma unroll
    for (int nt = 0; nt < kWarpTileN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_acc[mi][nt][e] = 0.f;

  if constexpr (Traits::kFp8) {
    static_assert(D % 32 == 0, "FP8 tiles: pairs of k16 steps");
    // ldmatrix.x4 matrix m (lanes 8m .. 8m + 7 give its rows): rows (m % 2) * 8 of a 16-row
    // step, chunk m / 2 of a pair of chunks.
    const int matrix = lane / 8;
#pragma unroll
    for (int kp = 0; kp < D / 32; ++kp) {
      uint32_t a_even[kMRep][4], a_odd[kMRep][4];
#pragma unroll
      for (int mi = 0; mi < kMRep; ++mi) {
        q_fragment(mi, 2 * kp, a_even[mi]);
        q_fragment(mi, 2 * kp + 1, a_odd[mi]);
      }
#pragma unroll
      for (int nj = 0; nj < kWarpTileN / 16; ++nj) {
        uint32_t r[4];
        const int row = warp_col0 + nj * 16 + (matrix % 2) * 8 + (lane % 8);
        const int ch = 2 * kp + matrix / 2;
        ldmatrix_x4(shared_address(k_tile + tile_offset<D, kSwizzle, kChunkElements>(row, ch)), r);
        // r[i] holds 4 bytes of a row: elements 0, 1 are k 2t, 2t + 1 and 2, 3 are 2t + 8, 2t + 9;
        // r[0], r[1] the even k16 step of n8 blocks 2 nj, 2 nj + 1, r[2], r[3] the odd one.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t lo = fp8_pair_to_f16x2<kE5M2, false>(r[i]);
          const uint32_t hi = fp8_pair_to_f16x2<kE5M2, true>(r[i]);
#pragma unroll
          for (int mi = 0; mi < kMRep; ++mi)
            mma_m16n8k16<__half>(s_acc[mi][2 * nj + i % 2], i < 2 ? a_even[mi] : a_odd[mi], lo, hi);
        }
      }
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[kMRep][4];
#pragma unroll
      for (int mi = 0; mi < kMRep; ++mi) q_fragment(mi, ks, a[mi]);
#pragma unroll
      for (int nj = 0; nj < kWarpTileN / 16; ++nj) {
        uint32_t b[4];
        const int r = warp_col0 + nj * 16 + (lane % 8) + (lane / 16) * 8;
        const int ch = ks * 2 + (lane / 8) % 2;
        ldmatrix_x4(shared_address(k_tile + tile_offset<D, kSwizzle, kChunkElements>(r, ch)), b);
#pragma unroll
        for (int mi = 0; mi < kMRep; ++mi) {
          mma_m16n8k16<T>(s_acc[mi][2 * nj], a[mi], b[0], b[1]);
          mma_m16n8k16<T>(s_acc[mi][2 * nj + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }

  transform_scores<kMRep * kWarpTileN / 2>(transform, [&](int i) -> float& {
    return s_acc[i / (kWarpTileN / 2)][(i / 4) % (kWarpTileN / 8)][i % 4];
  });
  if (needs_mask()) mask_scores(s_acc);

  // Online softmax (online_softmax.cuh). O is rescaled only when some lane's alpha differs from
  // 1; skipping a multiply by exactly 1 changes nothing.
  float alpha[kMRep][2];
#pragma unroll
  for (int mi = 0; mi < kMRep; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      alpha[mi][half] = online_softmax_row<kWarpTileN / 8, kFixedMax>(
          [&](int nt, int e) -> float& { return s_acc[mi][nt][half * 2 + e]; },
          state.row_max[mi][half], state.row_sum[mi][half], transform.exp_scale);
    }
  }
  bool rescale = false;
#pragma unroll
  for (int mi = 0; mi < kMRep; ++mi) rescale |= alpha[mi][0] != 1.f || alpha[mi][1] != 1.f;
  if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
    for (int mi = 0; mi < kMRep; ++mi)
#pragma unroll
      for (int dt = 0; dt < DV / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) state.o[mi][dt][e] *= alpha[mi][e / 2];
  }

  // O += P V: the S accumulators of two adjacent n8 tiles are the A fragment of one k16 step.
#pragma unroll
  for (int kk = 0; kk < kWarpTileN / 16; ++kk) {
    uint32_t a[kMRep][4];
#pragma unroll
    for (int mi = 0; mi < kMRep; ++mi) {
      a[mi][0] = pack_pair<P>(s_acc[mi][2 * kk][0], s_acc[mi][2 * kk][1]);
      a[mi][1] = pack_pair<P>(s_acc[mi][2 * kk][2], s_acc[mi][2 * kk][3]);
      a[mi][2] = pack_pair<P>(s_acc[mi][2 * kk + 1][0], s_acc[mi][2 * kk + 1][1]);
      a[mi][3] = pack_pair<P>(s_acc[mi][2 * kk + 1][2], s_acc[mi][2 * kk + 1][3]);
    }
    if constexpr (Traits::kFp8) {
      // Transposed matrices: m = 0 rows 0-7 and m = 1 rows 8-15 of the k16 step at chunk 2 dp,
      // m = 2, 3 the same at chunk 2 dp + 1; bytes 0, 2 of a register are one even d of two
      // rows, bytes 1, 3 the next odd d. Output n8 block 2 j + parity: chunk j's d of that parity.
      const int matrix = lane / 8;
#pragma unroll
      for (int dp = 0; dp < DV / 32; ++dp) {
        uint32_t r[4];
        const int row = warp_col0 + kk * 16 + (matrix % 2) * 8 + (lane % 8);
        const int ch = 2 * dp + matrix / 2;
        ldmatrix_x4_trans(
            shared_address(v_tile + tile_offset<DV, kVSwizzle, kChunkElements>(row, ch)), r);
        uint32_t even[4], odd[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) fp8_strided_pairs_to_f16x2<kE5M2>(r[i], even[i], odd[i]);
#pragma unroll
        for (int mi = 0; mi < kMRep; ++mi) {
          mma_m16n8k16<__half>(state.o[mi][4 * dp], a[mi], even[0], even[1]);
          mma_m16n8k16<__half>(state.o[mi][4 * dp + 1], a[mi], odd[0], odd[1]);
          mma_m16n8k16<__half>(state.o[mi][4 * dp + 2], a[mi], even[2], even[3]);
          mma_m16n8k16<__half>(state.o[mi][4 * dp + 3], a[mi], odd[2], odd[3]);
        }
      }
    } else {
#pragma unroll
      for (int dj = 0; dj < DV / 16; ++dj) {
        uint32_t b[4];
        const int r = warp_col0 + kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        const int ch = dj * 2 + lane / 16;
        ldmatrix_x4_trans(
            shared_address(v_tile + tile_offset<DV, kVSwizzle, kChunkElements>(r, ch)), b);
#pragma unroll
        for (int mi = 0; mi < kMRep; ++mi) {
          mma_m16n8k16<T>(state.o[mi][2 * dj], a[mi], b[0], b[1]);
          mma_m16n8k16<T>(state.o[mi][2 * dj + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }
}

// FP8 tiles: the output column that element e (0-3, as the mma accumulator layout numbers them)
// of output n8 block `block` holds in lane `lane`: block 2 j + parity is chunk j's d of that
// parity, its n index g standing for d = 16 j + 2 g + parity.
__device__ __forceinline__ int fp8_output_column(int block, int lane, int e) {
  return 16 * (block / 2) + 4 * (lane % 4) + 2 * (e % 2) + block % 2;
}

// A decode query fragment in the order the FP8 tiles' k steps take (attend_kv_tile): a0, a2 are
// q[row][16 ks + 4 t .. + 3] of rows lane / 4 (and a1, a3 of + 8), two 8-byte loads; `offset`
// places element `element` of a row as load_query_rows laid it out.
template <typename T, typename Offset>
__device__ __forceinline__ void load_fp8_query_fragment(const T* q_smem, int row0, int lane, int ks,
                                                        Offset offset, uint32_t (&a)[4]) {
  const int t = lane % 4;
  const int chunk = 2 * ks + t / 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + lane / 4 + half * 8;
    const uint2 pair = *reinterpret_cast<const uint2*>(q_smem + offset(row, chunk) + (t % 2) * 4);
    a[half] = pair.x;      // a0 / a1: k 2t, 2t + 1
    a[half + 2] = pair.y;  // a2 / a3: k 2t + 8, 2t + 9
  }
}

// Sets the scores of kv positions that the warp's rows may not see to -inf (row_visibility in
// variant.cuh): rows from first_row (the warp's first), kv positions from first_col (the warp's
// first of the tile).
template <typename Traits, typename Scores>
__device__ __forceinline__ void mask_invisible_scores(Scores& s_acc, const PagedAttentionParams& p,
                                                      const SequenceRows& seq, const KvRange& range,
                                                      int lane, int first_row, int first_col) {
  const int lane_row = lane / 4, lane_col = (lane % 4) * 2;
#pragma unroll
  for (int mi = 0; mi < Traits::kRowBlocksPerWarp; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const RowVisibility seen =
          row_visibility(p, seq, range, first_row + mi * 16 + lane_row + half * 8);
#pragma unroll
      for (int nt = 0; nt < Traits::kWarpTileN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (!visible(seen, first_col + nt * 8 + lane_col + e))
            s_acc[mi][nt][half * 2 + e] = -INFINITY;
        }
      }
    }
  }
}

// Full row sums (the 4 lanes of a quad hold disjoint columns of the same row) and row maxima in
// the log2 domain (the merges and the LSE use it), once the last tile is done.
template <typename Traits>
__device__ __forceinline__ void finish_row_states(WarpSoftmaxState<Traits>& state,
                                                  float exp_scale) {
  constexpr int kMRep = Traits::kRowBlocksPerWarp;
#pragma unroll
  for (int mi = 0; mi < kMRep; ++mi) {
    state.row_max[mi][0] *= exp_scale;
    state.row_max[mi][1] *= exp_scale;
  }
#pragma unroll
  for (int mi = 0; mi < kMRep; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float s = state.row_sum[mi][half];
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      state.row_sum[mi][half] = s;
    }
}

// Decode: the softmax states of 4 columns of a row (max in the log2 domain, sum, unnormalized
// output), merged over the block's warps: the kItems (row, float4 column) items of this thread.
// Item i of thread tid is item tid + i * kThreads of the 16 x D / 4 grid, row-major, so where the
// threads divide into whole rows a thread keeps one column (column(tid, i) the same for every i).
template <typename Traits>
struct MergedRows {
  static constexpr int kColumns = Traits::kVColumns / 4;
  static constexpr int kItems = 16 * kColumns / Traits::kThreads;
  static_assert((16 * kColumns) % Traits::kThreads == 0, "merge items");
  float m[kItems], l[kItems];
  float4 o[kItems];
  __device__ __forceinline__ static int row(int tid, int i) {
    return (tid + i * Traits::kThreads) / kColumns;
  }
  __device__ __forceinline__ static int column(int tid, int i) {
    return (tid + i * Traits::kThreads) % kColumns;
  }
};

// Decode: merges the states of the warps (each saw kWarpTileN positions of every tile) through
// `merge` in shared memory (Traits::kMergeBytes); thread tid takes the items of MergedRows. Rows at
// or past valid_rows (padding a GQA group to 16) are neither written nor read. sync() is the
// group's barrier, between the writes and the reads; the caller makes sure no thread still reads
// what the region holds before (it may alias the K/V stages).
template <typename Traits, typename Sync>
__device__ __forceinline__ MergedRows<Traits> merge_warp_states(
    unsigned char* merge, const WarpSoftmaxState<Traits>& state, int tid, int valid_rows,
    Sync&& sync) {
  constexpr int D = Traits::kVColumns;  // the block's output columns
  constexpr float kNegInf = -INFINITY;
  const int warp = tid / 32, lane = tid % 32;
  const int lane_row = lane / 4, lane_col = (lane % 4) * 2;
  float* merge_o = reinterpret_cast<float*>(merge);  // [kWarps][16][kMergeRowStride]
  float* merge_m = merge_o + Traits::kWarps * 16 * Traits::kMergeRowStride;  // [kWarps][16]
  float* merge_l = merge_m + Traits::kWarps * 16;                            // [kWarps][16]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = lane_row + half * 8;
    if (r >= valid_rows) continue;
    float* dst = merge_o + (warp * 16 + r) * Traits::kMergeRowStride + lane_col;
    if constexpr (Traits::kFp8) {
      // Blocks 2 j and 2 j + 1 hold d = 16 j + 4 t .. + 3 of this lane (fp8_output_column).
      float* row_dst = merge_o + (warp * 16 + r) * Traits::kMergeRowStride + 2 * lane_col;
#pragma unroll
      for (int j = 0; j < D / 16; ++j)
        *reinterpret_cast<float4*>(row_dst + 16 * j) =
            make_float4(state.o[0][2 * j][half * 2], state.o[0][2 * j + 1][half * 2],
                        state.o[0][2 * j][half * 2 + 1], state.o[0][2 * j + 1][half * 2 + 1]);
    } else {
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<float2*>(dst + dt * 8) =
            make_float2(state.o[0][dt][half * 2], state.o[0][dt][half * 2 + 1]);
    }
    if (lane % 4 == 0) {
      merge_m[warp * 16 + r] = state.row_max[0][half];
      merge_l[warp * 16 + r] = state.row_sum[0][half];
    }
  }
  sync();

  MergedRows<Traits> merged;
#pragma unroll
  for (int i = 0; i < MergedRows<Traits>::kItems; ++i) {
    const int r = MergedRows<Traits>::row(tid, i);
    const int c = MergedRows<Traits>::column(tid, i) * 4;
    const bool valid = r < valid_rows;
    float m = kNegInf;
#pragma unroll
    for (int w = 0; w < Traits::kWarps; ++w)
      if (valid) m = fmaxf(m, merge_m[w * 16 + r]);
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m != kNegInf) {
#pragma unroll
      for (int w = 0; w < Traits::kWarps; ++w) {
        const float weight = exp2f(merge_m[w * 16 + r] - m);
        l += merge_l[w * 16 + r] * weight;
        const float4 o =
            *reinterpret_cast<const float4*>(merge_o + (w * 16 + r) * Traits::kMergeRowStride + c);
        acc.x += o.x * weight;
        acc.y += o.y * weight;
        acc.z += o.z * weight;
        acc.w += o.w * weight;
      }
    }
    merged.m[i] = m;
    merged.l[i] = l;
    merged.o[i] = acc;
  }
  return merged;
}

}  // namespace astr::kernels
