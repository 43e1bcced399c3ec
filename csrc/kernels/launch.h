// Host entry points of the paged-KV-cache kernels. Torch-free: the binding layer
// (csrc/backends/*_cuda.cu) fills the parameter structs and raises on a returned error.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "paged_attention_params.h"

namespace astrai::kernels {

// Result of a launch: empty `error` on success, otherwise a message for the user (an unsupported
// configuration, or the CUDA error reported right after the launch).
struct LaunchStatus {
  std::string error;
  bool ok() const { return error.empty(); }
};

// The error of the launch just made, if any, prefixed with what was launched.
inline LaunchStatus status_after_launch(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return {};
  return {std::string(what) + ": " + cudaGetErrorString(error)};
}

// Head dims that have compiled attention kernels (append_kv takes any D with 16-byte rows).
bool is_supported_head_dim(int head_dim);
// "unsupported head_dim 96 (supported: 64, 128, 256)"
std::string unsupported_head_dim_message(int head_dim);

LaunchStatus launch_append_kv(const AppendKVParams& params, cudaStream_t stream);

// Split count for a decode call, from shapes only (never from seq_lens' values): so a captured
// graph stays valid as lengths grow. max_kv_len = block_table width * page size.
int paged_decode_num_splits(int num_seqs, int num_q_heads, int num_kv_heads, int max_kv_len,
                            int head_dim, int num_sms);
// Whether the decode merges `num_splits` splits inside a thread-block cluster on the current
// device: sm_90 or newer, and 2 splits (see paged_attention_dispatch.cu for why only 2).
bool paged_decode_can_merge_in_cluster(int num_splits);
// Whether the decode runs its `num_splits` splits as block pairs (one block of two groups of warps
// per (sequence, kv head, row tile), merged in its shared memory) on the current device: 2 splits,
// a head dim with a pair kernel, and room for the pair (paged_attention_dispatch.cu).
bool paged_decode_can_merge_in_block_pairs(int num_splits, int head_dim);
// Whether the decode can run one split as eight-warp blocks (PagedAttentionTraits' kWarps) on the
// current device: 1 split, a head dim with that kernel, and room for the block.
bool paged_decode_can_run_eight_warp_blocks(int num_splits, int head_dim);
// Decode items: (sequence, kv head, row tile of 16 query rows) triples.
int64_t paged_decode_items(int num_seqs, int num_q_heads, int num_kv_heads);
// Whether the persistent decode (one split, D = 128) can run on a grid of `blocks` on the current
// device: room for its block.
bool paged_decode_can_run_persistent(int num_splits, int head_dim, int64_t num_items, int blocks);
// Whether block pairs would cover more than 2/3 of the SMs (decode_block_pairs_fill_gpu in
// paged_decode_splits.h says why); where they would not, 2 splits run as 2 blocks.
bool paged_decode_block_pairs_fill_gpu(int num_seqs, int num_q_heads, int num_kv_heads,
                                       int num_sms);
// Float workspace the decode needs for `num_splits` (0 when num_splits == 1 or the splits merge in
// place: in a cluster or a block pair).
size_t paged_decode_workspace_floats(int num_splits, bool merged_in_place, int num_tokens,
                                     int num_q_heads, int head_dim);

// Whether the wgmma prefill kernel (D = 64 or 128) can run here: a library built for sm_90a, on
// an sm_90 device. Otherwise prefill runs the mma.sync kernel (sm_80 and newer).
bool paged_prefill_wgmma_runs_here();

LaunchStatus launch_paged_decode(const PagedDecodeParams& params, cudaStream_t stream);
LaunchStatus launch_paged_prefill(const PagedPrefillParams& params, cudaStream_t stream);

}  // namespace astrai::kernels
