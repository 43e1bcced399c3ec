// The kernels' argument block, and the launch templates that the generated instantiation files
// define: one .cu per family, head dim, q type and kv kind (scripts/generate_instantiations.py
// writes them from config.h), so the build compiles them in parallel and launch.cu's dispatch
// compiles no kernel itself.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/launch_status.h"
#include "params.h"
#include "plan.h"

namespace astr::kernels {

// Everything a kernel reads, flattened from the params and the plan.
struct PagedKernelArgs {
  PagedAttentionParams base;
  const int32_t* query_start_loc;  // prefill, verify: [B + 1]; null in decode (token b = seq b)
  int max_query_len;               // prefill, verify: the grid's new tokens per sequence
  int num_splits;                  // decode: kv tile sets per (sequence, kv head, row tile)
  int split_tiles;                 // decode: 0, split s takes tiles s, s + S, ...; else this many
                                   // consecutive tiles from s * split_tiles (DecodePlan)
  bool merge_in_cluster;           // decode: the 2 splits form a cluster and merge in it
  int persistent_blocks;           // persistent decode and prefill: the grid
  int* claim_counter;              // persistent decode: items claimed beyond the grid's first
  bool early_start;                // persistent decode: a dependent launch of the counter's reset
  float* partial_out;              // split decode: [num_splits, T, Hq, D] fp32
  float* partial_lse;              // split decode: [num_splits, T, Hq] fp32 (log2 domain)
  int32_t* listed_positions;       // top-k: [T, topk], PagedTopkParams::listed_positions
  int topk_table_slots;            // top-k: the listing pass' hash table (TopkPlan::table_slots)
  float scale_log2;                // scale * log2(e): softmax runs on exp2
  bool pool_boxes;                 // prefill: the plan lets a kernel copy K/V by TMA boxes
  int panel_pairs;                 // prefill: the block order's panels (PrefillPlan; 0: one)
  int32_t* prefill_schedule;       // persistent prefill: the scheduler's workspace
  bool round_robin;                // persistent prefill: items every grid-th, not claimed
};

// The current device's compute capability as major * 10 + minor (0 when it cannot be read); the
// answer is kept per device.
int current_device_arch();
// sm_90 or newer: programmatic dependent launch, clusters.
inline bool current_device_is_sm90_or_newer() { return current_device_arch() >= 90; }

// Decode for q/k head dim D, v head dim DV, q type T, kv type KV, in the plan's form
// (decode_kernel.cuh; the merge kernel follows a split decode). Not the persistent form:
template <int D, int DV, typename T, typename KV>
LaunchStatus run_paged_decode(const PagedKernelArgs& args, DecodeForm form, cudaStream_t stream);

// Sparse top-k attention, decode or prefill (topk_attention_kernel.cuh): the listing pass, the
// attention kernel over the listed keys on args.num_splits splits, the merge kernel after more than
// one, and for a prefill the unplaced rows' poison; q/k head dim D, v's DV (up to 256).
template <int D, int DV, typename T, typename KV>
LaunchStatus run_paged_topk(const PagedKernelArgs& args, cudaStream_t stream);

// The forms below take equal q/k and v head dims D (config.h compiles them for no other row).
// The persistent decode (decode_persistent_kernel.cuh), on a grid of args.persistent_blocks.
template <int D, typename T, typename KV>
LaunchStatus run_paged_decode_persistent(const PagedKernelArgs& args, cudaStream_t stream);

// Prefill on mma.sync (prefill_mma_sync_kernel.cuh), sm_80 and newer; q/k head dim D, v's DV.
template <int D, int DV, typename T, typename KV>
LaunchStatus run_paged_prefill(const PagedKernelArgs& args, cudaStream_t stream);

// Prefill on wgmma (prefill_wgmma_kernel.cuh): sm_90 (exactly: sm_90a code) in a library built for
// sm_90a.
template <int D, typename T, typename KV>
LaunchStatus run_paged_prefill_wgmma(const PagedKernelArgs& args, cudaStream_t stream);

// The warp-specialised prefill on wgmma (prefill_warp_specialized_kernel.cuh): as above.
template <int D, typename T, typename KV>
LaunchStatus run_paged_prefill_warp_specialized(const PagedKernelArgs& args, cudaStream_t stream);

// Its persistent form (prefill_persistent_kernel.cuh): the scheduler's sort, then one block per SM
// (at most args.persistent_blocks) looping over items; as above.
template <int D, typename T, typename KV>
LaunchStatus run_paged_prefill_persistent(const PagedKernelArgs& args, cudaStream_t stream);

}  // namespace astr::kernels
