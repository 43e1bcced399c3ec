// Split-KV merge of the paged decode: out[t, h] = sum_s w_s o_s / (sum_s w_s + sink), w_s =
// exp2(lse_s - max), over the num_splits partial results (each normalized, with its log2-sum-exp)
// in the workspace; the row's sink, if any, joins here once (variant.cuh's finish_row).
//
// One block per output row (token, q head). Thread (group g, column c) owns 4 dims and the splits
// g, g + kGroups, ...: it issues all loads of a round (kMergeRound splits) before using any, keeps
// its own softmax state, and the groups combine through shared memory. So a row's splits are read
// in parallel by the whole block in one or a few round trips, where a thread per 4 dims walking
// every split left the merge bound by parallelism (benchmarks/results/decisions.md, "Decode: the
// merge kernel").
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "../common/dependent_launch.cuh"
#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "instantiations.h"
#include "variant.cuh"

namespace astr::kernels {

constexpr int kMergeRound = 8;  // splits per thread whose loads are in flight together

// Threads of a merge block: whole rows of D / 4 float4 columns, about 128.
template <int D>
struct MergeShape {
  static constexpr int kColumns = D / 4;          // float4 columns of a row
  static constexpr int kGroups = 128 / kColumns;  // D = 64: 8, 96: 5, 128: 4, 256: 2
  static constexpr int kThreads = kGroups * kColumns;
};

template <typename T, int D>
__global__ void __launch_bounds__(MergeShape<D>::kThreads)
    paged_decode_merge_kernel(const __grid_constant__ PagedKernelArgs args) {
  constexpr int kColumns = MergeShape<D>::kColumns;
  constexpr int kGroups = MergeShape<D>::kGroups;
  constexpr float kNegInf = -INFINITY;

  const PagedAttentionParams& p = args.base;
  const int64_t rows = (int64_t)p.num_tokens * p.num_q_heads;
  const int64_t row = blockIdx.x;
  const int column = threadIdx.x % kColumns;
  const int group = threadIdx.x / kColumns;
  const int num_splits = args.num_splits;
  const float* lse = args.partial_lse + row;                       // split s at lse[s * rows]
  const float* partial = args.partial_out + row * D + column * 4;  // split s at [s * rows * D]

  wait_for_prerequisite_grid();  // the attention kernel's partial results (no-op unless PDL)
  float m = kNegInf, l = 0.f;
  bool poisoned = false;  // a split wrote NaN (variant.cuh: poison)
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int first = group; first < num_splits; first += kGroups * kMergeRound) {
    float split_lse[kMergeRound];
    float4 split_out[kMergeRound];
#pragma unroll
    for (int i = 0; i < kMergeRound; ++i) {
      const int split = first + i * kGroups;
      const bool valid = split < num_splits;
      split_lse[i] = valid ? lse[(int64_t)split * rows] : kNegInf;
      split_out[i] = valid ? *reinterpret_cast<const float4*>(partial + (int64_t)split * rows * D)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float round_max = kNegInf;
#pragma unroll
    for (int i = 0; i < kMergeRound; ++i) {
      round_max = fmaxf(round_max, split_lse[i]);
      poisoned |= split_lse[i] != split_lse[i];
    }
    if (round_max == kNegInf) continue;  // only empty splits (lse -inf) in this round
    const float new_m = fmaxf(m, round_max);
    const float keep = exp2f(m - new_m);  // 0 while m is -inf
    l *= keep;
    acc.x *= keep;
    acc.y *= keep;
    acc.z *= keep;
    acc.w *= keep;
#pragma unroll
    for (int i = 0; i < kMergeRound; ++i) {
      const float w = exp2f(split_lse[i] - new_m);  // an empty split weighs 0
      l += w;
      acc.x += split_out[i].x * w;
      acc.y += split_out[i].y * w;
      acc.z += split_out[i].z * w;
      acc.w += split_out[i].w * w;
    }
    m = new_m;
  }

  __shared__ float group_m[kGroups], group_l[kGroups];
  __shared__ float4 group_acc[kGroups][kColumns];
  if (column == 0) {
    group_m[group] = m;
    group_l[group] = poison_sum(l, poisoned);
  }
  group_acc[group][column] = acc;
  __syncthreads();
  if (group != 0) return;

  float max_m = kNegInf;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) max_m = fmaxf(max_m, group_m[g]);
  float total = 0.f;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    // An empty group weighs 0; a poisoned one makes the total NaN.
    const float w = group_m[g] == kNegInf ? 0.f : exp2f(group_m[g] - max_m);
    total += group_l[g] * w;
    const float4 a = group_acc[g][column];
    sum.x += a.x * w;
    sum.y += a.y * w;
    sum.z += a.z * w;
    sum.w += a.w * w;
  }
  const int token = static_cast<int>(row / p.num_q_heads);
  const int head = static_cast<int>(row % p.num_q_heads);
  // A row that saw no key (and has no sink) is written as zeros.
  const FinishedRow finished = finish_row(max_m, total, sink_log2(p, head));
  const float inv = finished.inv;
  T* dst =
      static_cast<T*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + column * 4;
  uint2 packed;
  packed.x = pack_pair<T>(sum.x * inv, sum.y * inv);
  packed.y = pack_pair<T>(sum.z * inv, sum.w * inv);
  *reinterpret_cast<uint2*>(dst) = packed;
  if (column == 0) store_lse(p, token, head, finished.lse_log2);
}

// On sm_90 the merge is a programmatic dependent launch: its blocks are scheduled while the decode
// kernel's last blocks run and wait in griddepcontrol.wait, which removes the launch gap between
// the two kernels (also inside a captured CUDA graph). Elsewhere a plain launch.
template <typename T, int D>
LaunchStatus launch_paged_decode_merge(const PagedKernelArgs& args, cudaStream_t stream) {
  const int64_t rows = (int64_t)args.base.num_tokens * args.base.num_q_heads;
  const cudaError_t launched = launch_maybe_dependent(
      paged_decode_merge_kernel<T, D>, dim3(static_cast<unsigned>(rows)),
      dim3(MergeShape<D>::kThreads), 0, stream, current_device_is_sm90_or_newer(), args);
  if (launched != cudaSuccess)
    return {std::string("paged_decode_merge_kernel: ") + cudaGetErrorString(launched)};
  return status_after_launch("paged_decode_merge_kernel");
}

}  // namespace astr::kernels
