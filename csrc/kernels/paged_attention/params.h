// Parameter structs of the paged-KV-cache attention kernels. Plain data: raw pointers, element
// strides and sizes, so that this header and everything under csrc/kernels/ builds without
// libtorch.
//
// Layout shared by every paged kernel: a pool of P pages, each holding S token slots
// (S a power of two), each slot holding Hkv heads of D elements. Sequence b owns the pages
// block_table[b][0..], in order, so its kv position `pos` lives at page block_table[b][pos / S],
// offset pos % S.
#pragma once

#include <cstdint>

#include "../common/scalar_type.h"

namespace astr::kernels {

// Fields common to the decode and prefill kernels.
//
// Query rows: new token i of sequence b is q[query_start(b) + i] and sits at absolute kv position
// p = seq_lens[b] - q_len(b) + i. It sees kv positions `pos` with
//   max(0, p - window_left) <= pos   (window_left >= 0; -1: no lower bound),
//   pos <= p                         (is_causal; otherwise pos < seq_lens[b]),
//   pos < mask_kv_len and attn_mask[token][pos]   (attn_mask not null),
//   pos < first_pos or tree_mask[token][pos - first_pos]   (tree_mask not null; first_pos =
//                                    seq_lens[b] - q_len(b): new token i sees the cached prefix and
//                                    new token j of its sequence where column j is true; the causal
//                                    edge pos <= p no longer applies; with no attn_mask).
// Scores: s = scale * q . k * k_scale[kv head]; with softcap > 0, s = softcap * tanh(s / softcap)
// (before masking). Softmax over the visible positions plus, with sinks, one extra logit
// sinks[q head] that has no value. A row that sees no position (and has no sink) is written as
// zeros, with lse -inf.
//
// Bad metadata never makes a kernel touch memory outside q, the pools, the block table, the
// output and its own workspace: a page id outside [0, num_pages) is never read, and the rows of a
// sequence whose length exceeds its block-table row or is below its new tokens, or that meets
// such a page id, are written as NaN (variant.cuh, "poison"). In decode a length of 0 is a
// padding slot: zeros. Rows of a prefill sequence whose query_start_loc range holds more tokens
// than max_query_len are NaN (all of them: query_rows.cuh writes those past the grid), and so is
// every row of a batch whose query_start_loc does not run from 0 to T without decreasing.
struct PagedAttentionParams {
  const void* q;           // [T, Hq, D], last dim contiguous, strides multiples of 16 bytes
  int64_t q_stride_token;  // elements between q[t] and q[t + 1]
  int64_t q_stride_head;   // elements between q[t, h] and q[t, h + 1]
  ScalarType q_dtype;      // kBFloat16 or kFloat16; also the output's

  const void* k_cache;  // [P, S, Hkv, D], last dim contiguous, strides multiples of 16 bytes
  const void* v_cache;  // [P, S, Hkv, Dv], k_cache's shape but for v's head dim
  int64_t k_stride_page, k_stride_slot, k_stride_head;  // elements
  int64_t v_stride_page, v_stride_slot, v_stride_head;  // elements
  ScalarType kv_dtype;                                  // q_dtype, or an FP8 type
  int num_pages;                                        // P
  // FP8 caches: the value of an element is stored.float() * scale[kv head]; null otherwise. The
  // decode folds k_scale into the score scale and applies v_scale once to each output row.
  const float* k_scale;  // [Hkv] float32
  const float* v_scale;  // [Hkv] float32

  const int32_t* block_table;  // [B, W] int32, page ids of each sequence, last dim contiguous
  int64_t block_table_stride;  // elements between block_table[b] and block_table[b + 1]
  int block_table_width;       // W; W * S bounds every valid seq_len
  const int32_t* seq_lens;     // [B] int32, kv length of each sequence including its new tokens

  const bool* attn_mask;      // [T, K] bool (True = attend) or null; last dim contiguous
  int64_t mask_stride_token;  // elements between attn_mask[t] and attn_mask[t + 1]
  int mask_kv_len;            // K

  // Speculative decoding's verify: which new tokens of its own sequence each new token sees.
  const bool* tree_mask;           // [T, tree_mask_width] bool or null; last dim contiguous
  int64_t tree_mask_stride_token;  // elements between tree_mask[t] and tree_mask[t + 1]
  int tree_mask_width;             // columns, >= max_query_len; j >= width is not visible

  // Sparse top-k attention: row t sees only the kv positions that topk_indices[t] lists
  // (positions within its sequence, shared by all heads; -1 lists nothing, a position listed twice
  // counts once) and that the rules above also allow. An entry below -1 or past its sequence makes
  // the token's rows NaN (a decode padding slot, length 0, stays zeros). Run by the top-k kernels
  // alone (topk_attention_kernel.cuh), decode or prefill.
  const int32_t* topk_indices;  // [T, topk] int32 or null; last dim contiguous
  int64_t topk_stride_token;    // elements between topk_indices[t] and topk_indices[t + 1]
  int topk;                     // entries per row

  // Variants (variant.cuh).
  int window_left;     // >= 0: a row at position p sees p - window_left .. p; -1: no window
  float softcap;       // > 0: scores become softcap * tanh(s / softcap); 0: off
  const float* sinks;  // [Hq] float32 extra logit per q head, or null
  float* lse;          // [T, Hq] float32, natural log of each row's softmax denominator, or null
  int64_t lse_stride_token;  // elements between lse[t] and lse[t + 1]

  void* out;                 // [T, Hq, Dv], written, q_dtype
  int64_t out_stride_token;  // elements
  int64_t out_stride_head;   // elements

  int num_seqs;        // B
  int num_tokens;      // T
  int num_q_heads;     // Hq
  int num_kv_heads;    // Hkv; Hq % Hkv == 0
  int head_dim;        // D, of q and k
  int head_dim_v;      // of v and the output (D but for config.h's rows of their own; 0: D)
  int log2_page_size;  // log2(S)
  bool is_causal;
  float scale;  // softmax scale applied to q . k
};

// Prefill: a ragged batch of new tokens per sequence.
struct PagedPrefillParams : PagedAttentionParams {
  const int32_t* query_start_loc;  // [B + 1] int32 prefix sums of new-token counts
  int max_query_len;               // host upper bound of new tokens per sequence (sizes the grid)
  // The persistent prefill's scheduler workspace (prefill_tile_scheduler.h:
  // prefill_schedule_ints), written by the launch in the stream; null for the other kernels.
  int32_t* schedule_workspace;
};

// Decode: exactly one new token per sequence (T == B, token b belongs to sequence b). How it runs
// (the form, its splits, its grid) is the plan's (plan.h).
struct PagedDecodeParams : PagedAttentionParams {
  int* persistent_claim_counter;  // persistent decode: one int, zeroed by the launch
  float* workspace;               // plan.workspace_floats floats, or null when the plan needs none
};

// Sparse top-k attention, decode or prefill (plan.h: TopkPlan): every query token is its own work
// item, its kv positions those its topk_indices row lists.
struct PagedTopkParams : PagedAttentionParams {
  const int32_t* query_start_loc;  // prefill: [B + 1] int32 prefix sums; null in decode (token b
                                   // is sequence b's one new token)
  int max_query_len;               // prefill: host upper bound of new tokens per sequence
  // [T, topk] int32 scratch: each row's entries as the attention kernel reads them (the listing
  // pass writes them): the position, or -1 (unused, masked, or a repeat), or -2 in every entry of
  // a row that bad metadata poisons.
  int32_t* listed_positions;
  float* workspace;  // plan.workspace_floats floats, or null when the plan needs none
};

// Verify: a prefill-mode call of a few new tokens per sequence (speculative decoding's drafts)
// run by the decode forms, whose rows pack (new token, q head) as the prefill's do, so that one
// block's K/V tiles serve several drafts (plan.h: prefill_runs_as_verify).
struct PagedVerifyParams : PagedDecodeParams {
  const int32_t* query_start_loc;  // [B + 1] int32 prefix sums of new-token counts
  int max_query_len;               // host upper bound of new tokens per sequence (sizes the grid)
};

}  // namespace astr::kernels
