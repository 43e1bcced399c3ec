// One row's step of the online softmax (FlashAttention-2) over a tile of scores, shared by the
// paged attention kernels. The row's scores sit in the 4 lanes of a quad (mma.sync and wgmma
// accumulator layouts alike: lane l holds columns 2 (l % 4) + {0, 1} of every n8 block).
#pragma once

#include <cmath>

#include "device_primitives.cuh"

namespace astr::kernels {

// score(nt, e) is this lane's score e (0, 1) of n8 block nt of the row, unscaled when the scale
// is folded into exp_scale (scale * log2 e > 0: exp2(s * c - max * c), one FFMA a score), scaled
// otherwise (exp_scale = 1). Replaces the scores by their exp2 weights, updates the running max
// and this lane's running sum, and returns alpha, the factor the row's output must be rescaled by.
// An unchanged max gives alpha = 1 outright: with the folded scale ptxas contracts
// row_max * exp_scale - base into one FFMA, whose rounding residual would otherwise give
// exp2(~1e-7) != 1 and defeat the kernels' skip of a rescale by exactly 1.
// kFixedMax: the scores are bounded (a softcap's tanh, variant.cuh) and the max stays 0: no max,
// no rescale (alpha = 1), the weights exp2(s * exp_scale) as they are. A template argument, as
// the kernels are compiled per softcap kind (Softcap, variant.cuh): a branch on it in the tile
// loop cost the prefill 3-8% (benchmarks/results/decisions.md, "Softcap").
template <int kBlocksN, bool kFixedMax, typename Score>
__device__ __forceinline__ float online_softmax_row(Score score, float& row_max, float& row_sum,
                                                    float exp_scale) {
  if constexpr (kFixedMax) {
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kBlocksN; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& s = score(nt, e);
        s = fast_exp2(s * exp_scale);
        sum += s;
      }
    }
    row_max = 0.f;
    row_sum += sum;
    return 1.f;
  }
  constexpr float kNegInf = -INFINITY;
  float tile_max = kNegInf;
#pragma unroll
  for (int nt = 0; nt < kBlocksN; ++nt)
    tile_max = fmaxf(tile_max, fmaxf(score(nt, 0), score(nt, 1)));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
  const float new_max = fmaxf(row_max, tile_max);
  // A row with no visible key yet keeps max -inf; subtract 0 then (exp2(-inf) = 0, no NaN).
  const float base = (new_max == kNegInf ? 0.f : new_max) * exp_scale;
  const float alpha = new_max == row_max ? 1.f : fast_exp2(row_max * exp_scale - base);
  row_max = new_max;
  float sum = 0.f;
#pragma unroll
  for (int nt = 0; nt < kBlocksN; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& s = score(nt, e);
      s = fast_exp2(fmaf(s, exp_scale, -base));
      sum += s;
    }
  }
  row_sum = row_sum * alpha + sum;
  return alpha;
}

}  // namespace astr::kernels
