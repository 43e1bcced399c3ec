// Parameter structs for the paged-KV-cache kernels. Plain data: raw pointers, element strides and
// sizes, so that this header and everything under csrc/kernels/ builds without libtorch.
//
// Layout shared by every paged kernel: a pool of P pages, each holding S token slots
// (S a power of two), each slot holding Hkv heads of D elements. Token slot `slot` of the pool is
// page slot / S, offset slot % S. Sequence b owns the pages block_table[b][0..], in order, so its
// kv position `pos` lives at page block_table[b][pos / S], offset pos % S.
#pragma once

#include <cstdint>

namespace astrai::kernels {

// Element type of q, k, v, the caches and the output (all the same).
enum class ScalarType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// append_kv: k_cache[slot / S, slot % S, h, :] = k[t, h, :] (same for v) for every token t whose
// slot_mapping[t] = slot is >= 0. Slots past the pool (>= P * S) are skipped as well.
struct AppendKVParams {
  const void* k;                // [T, Hkv, D], last dim contiguous
  const void* v;                // [T, Hkv, D], last dim contiguous
  void* k_cache;                // [P, S, Hkv, D], last dim contiguous
  void* v_cache;                // [P, S, Hkv, D], last dim contiguous
  const int32_t* slot_mapping;  // [T] int32, page * S + offset; negative = skip the token
  int64_t k_stride_token;       // elements between k[t] and k[t + 1]
  int64_t k_stride_head;        // elements between k[t, h] and k[t, h + 1]
  int64_t v_stride_token;
  int64_t v_stride_head;
  int64_t k_cache_stride_page;  // elements between pages of k_cache
  int64_t k_cache_stride_slot;  // elements between slots of one page
  int64_t k_cache_stride_head;  // elements between heads of one slot
  int64_t v_cache_stride_page;
  int64_t v_cache_stride_slot;
  int64_t v_cache_stride_head;
  int num_tokens;     // T
  int num_kv_heads;   // Hkv
  int head_dim;       // D; D * element size must be a multiple of 16 bytes
  int page_size;      // S (any positive value works here)
  int64_t num_pages;  // P
  ScalarType dtype;
};

// Fields common to the decode and prefill attention kernels.
//
// Query rows: new token i of sequence b is q[query_start(b) + i] and sits at absolute kv position
// seq_lens[b] - q_len(b) + i. With is_causal it sees kv positions <= that position, otherwise all
// positions < seq_lens[b]; attn_mask (when not null) further removes positions where it is false
// and every position >= mask_kv_len. A row that sees no position is written as zeros.
struct PagedAttentionParams {
  const void* q;           // [T, Hq, D], last dim contiguous, strides multiples of 8 elements
  int64_t q_stride_token;  // elements between q[t] and q[t + 1]
  int64_t q_stride_head;   // elements between q[t, h] and q[t, h + 1]

  const void* k_cache;  // [P, S, Hkv, D], last dim contiguous, strides multiples of 8 elements
  const void* v_cache;  // [P, S, Hkv, D], same shape as k_cache
  int64_t k_stride_page, k_stride_slot, k_stride_head;  // elements
  int64_t v_stride_page, v_stride_slot, v_stride_head;  // elements

  const int32_t* block_table;  // [B, W] int32, page ids of each sequence, last dim contiguous
  int64_t block_table_stride;  // elements between block_table[b] and block_table[b + 1]
  int block_table_width;       // W; W * S bounds every seq_len
  const int32_t* seq_lens;     // [B] int32, kv length of each sequence including its new tokens

  const bool* attn_mask;      // [T, K] bool (True = attend) or null; last dim contiguous
  int64_t mask_stride_token;  // elements between attn_mask[t] and attn_mask[t + 1]
  int mask_kv_len;            // K

  void* out;                 // [T, Hq, D], written
  int64_t out_stride_token;  // elements
  int64_t out_stride_head;   // elements

  int num_seqs;        // B
  int num_tokens;      // T
  int num_q_heads;     // Hq
  int num_kv_heads;    // Hkv; Hq % Hkv == 0
  int head_dim;        // D
  int log2_page_size;  // log2(S)
  bool is_causal;
  float scale;       // softmax scale applied to q . k
  ScalarType dtype;  // kFloat16 or kBFloat16
};

// Decode: exactly one new token per sequence (T == B, token b belongs to sequence b).
// Split-KV (FlashDecoding): each sequence's kv tiles are dealt out to num_splits blocks (split s
// takes tiles s, s + num_splits, ...), which stay balanced at every seq_len read on the device, so
// one launch configuration (and one captured CUDA graph) serves every length up to W * S. With
// num_splits > 1 the partial results go to the workspace and a merge kernel writes `out`, unless
// merge_in_cluster: then the splits of a (sequence, kv head) run as one thread-block cluster
// (sm_90, see paged_decode_can_merge_in_cluster) and merge through distributed shared memory, with
// no workspace and no second kernel. merge_in_block_pairs does the same without a cluster: the 2
// splits run as two groups of warps of one block and merge through its shared memory (where
// paged_decode_can_merge_in_block_pairs says the pair fits the SM as well as 2 blocks do).
// eight_warp_blocks (1 split): one block of 8 warps per (sequence, kv head, row tile), one per SM,
// which the binding runs in place of block pairs (paged_decode_eight_warp_blocks_pay).
// persistent_blocks (1 split): that many eight-warp blocks, one per SM, take the (sequence, kv
// head, row tile) items in turn (paged_decode_persistent_kernel.cuh), where the binding's rule says
// (decode_persistent_blocks_pay in paged_decode_splits.h).
struct PagedDecodeParams : PagedAttentionParams {
  int num_splits;             // from paged_decode_num_splits(); 1 = no workspace needed
  bool merge_in_cluster;      // only where paged_decode_can_merge_in_cluster(num_splits)
  bool merge_in_block_pairs;  // only where paged_decode_can_merge_in_block_pairs(...)
  bool eight_warp_blocks;     // only where paged_decode_can_run_eight_warp_blocks(...)
  int persistent_blocks;      // > 0: the persistent decode's grid (paged_decode_can_run_persistent)
  int* persistent_claim_counter;  // persistent decode: one int, zeroed by the launch (claims)
  // Persistent decode on sm_90: the decode is a programmatic dependent launch of the counter's
  // reset, so its blocks start while the reset runs (paged_decode_persistent_kernel.cuh).
  bool persistent_early_start;
  float* workspace;  // paged_decode_workspace_floats() floats, or null when none are needed
};

// Which prefill kernel runs: kAuto picks (wgmma where it runs and pays, see
// paged_attention_dispatch.cu); kWgmma takes wgmma wherever it runs (sm_90, D = 64 or 128);
// kMmaSync never does. Tests and A/B runs force the last two.
enum class PrefillKernel : int { kAuto = 0, kWgmma = 1, kMmaSync = 2 };

// Prefill: a ragged batch of new tokens per sequence.
struct PagedPrefillParams : PagedAttentionParams {
  const int32_t* query_start_loc;  // [B + 1] int32 prefix sums of new-token counts
  int max_query_len;               // host upper bound of new tokens per sequence (sizes the grid)
  PrefillKernel kernel = PrefillKernel::kAuto;
};

}  // namespace astrai::kernels
