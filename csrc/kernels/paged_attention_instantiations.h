// Declarations of the paged attention instantiations, each defined in its own
// paged_{decode,prefill}_hdim<D>.cu (so the host dispatch does not compile every kernel again).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"
#include "paged_attention_params.h"

namespace astrai::kernels {

// Everything the kernel reads, flattened from PagedDecodeParams / PagedPrefillParams.
struct PagedKernelArgs {
  PagedAttentionParams base;
  const int32_t* query_start_loc;  // [B + 1], null in decode (token b = sequence b)
  int num_splits;                  // decode: kv chunks per sequence (grid z)
  bool merge_in_cluster;           // decode: the splits form a cluster and merge in it
  bool merge_in_block_pairs;       // decode: 2 splits run as one block of two groups
  bool eight_warp_blocks;          // decode, 1 split: one block of 8 warps per row tile
  int persistent_blocks;           // decode, 1 split: > 0, the persistent kernel's grid
  int* claim_counter;              // persistent decode: items claimed beyond the grid's first
  bool early_start;                // persistent decode: a dependent launch of the counter's reset
  float* partial_out;              // [num_splits, T, Hq, D] fp32 when num_splits > 1
  float* partial_lse;              // [num_splits, T, Hq] fp32 (log2 domain)
  float scale_log2;                // scale * log2(e): softmax runs on exp2
};

// The current device's compute capability as major * 10 + minor (0 when it cannot be read); the
// answer is kept per device.
int current_device_arch();
// sm_90 or newer: programmatic dependent launch, clusters.
inline bool current_device_is_sm90_or_newer() { return current_device_arch() >= 90; }

// Launches the attention kernel for head dim D, element type T (__nv_bfloat16 or __half), decode or
// prefill, over grid_rows packed query rows per (sequence, kv head); decode with num_splits > 1
// launches it as clusters that merge their splits (merge_in_cluster) or also launches the merge
// kernel. Returns the launch error, if any.
template <int D, typename T, bool kDecode>
LaunchStatus run_paged_attention(const PagedKernelArgs& args, int grid_rows, cudaStream_t stream);

// The persistent eight-warp decode (paged_decode_persistent_kernel.cuh), D = 128, 1 split, on a
// grid of args.persistent_blocks.
template <typename T>
LaunchStatus run_paged_decode_persistent(const PagedKernelArgs& args, cudaStream_t stream);

// The prefill kernel on wgmma (paged_prefill_wgmma_kernel.cuh), D = 64 or 128. Runs only on
// sm_90 (exactly: sm_90a code) in a library built for sm_90a; see paged_prefill_wgmma_runs_here.
template <int D, typename T>
LaunchStatus run_paged_prefill_wgmma(const PagedKernelArgs& args, int grid_rows,
                                     cudaStream_t stream);

}  // namespace astrai::kernels
