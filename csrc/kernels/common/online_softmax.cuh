// One row's step of the online softmax (FlashAttention-2) over a tile of scores, shared by the
// paged attention kernels. The row's scores sit in the 4 lanes of a quad (mma.sync and wgmma
// accumulator layouts alike: lane l holds columns 2 (l % 4) + {0, 1} of every n8 block).
#pragma once

#include <cmath>

#include "device_primitives.cuh"

namespace astrai::kernels {

// score(nt, e) is this lane's score e (0, 1) of n8 block nt of the row, unscaled when the scale
// is folded into exp_scale (scale * log2 e > 0: exp2(s * c - max * c), one FFMA a score), scaled
// otherwise (exp_scale = 1). Replaces the scores by their exp2 weights, updates the running max
// and this lane's running sum, and returns alpha, the factor the row's output must be rescaled by.
// An unchanged max gives alpha = 1 outright: with the folded scale ptxas contracts
// row_max * exp_scale - base into one FFMA, whose rounding residual would otherwise give
// exp2(~1e-7) != 1 and defeat the kernels' skip of a rescale by exactly 1.
// exp2_on_fma (uniform): how many scores of each pair take their exp2 on the FMA pipe (fma_exp2 in
// device_primitives.cuh) instead of the SFU, 0, 1 or 2: where the SFU also computes a tanh per
// score (a softcap, variant.cuh), it is the busier unit.
template <int kBlocksN, typename Score>
__device__ __forceinline__ float online_softmax_row(Score score, float& row_max, float& row_sum,
                                                    float exp_scale, int exp2_on_fma) {
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
  auto weigh = [&](auto exp0, auto exp1) {
#pragma unroll
    for (int nt = 0; nt < kBlocksN; ++nt) {
      float& s0 = score(nt, 0);
      float& s1 = score(nt, 1);
      s0 = exp0(fmaf(s0, exp_scale, -base));
      s1 = exp1(fmaf(s1, exp_scale, -base));
      sum += s0;
      sum += s1;
    }
  };
  auto on_sfu = [](float x) { return fast_exp2(x); };
  auto on_fma = [](float x) { return fma_exp2(x); };
  if (exp2_on_fma == 0)
    weigh(on_sfu, on_sfu);
  else if (exp2_on_fma == 1)
    weigh(on_sfu, on_fma);
  else
    weigh(on_fma, on_fma);
  row_sum = row_sum * alpha + sum;
  return alpha;
}

}  // namespace astrai::kernels
