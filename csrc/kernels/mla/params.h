// Parameter structs of the latent-attention kernels (astr::mla_attention's cuda backend and
// astr::append_mla). Plain data: raw pointers, element strides and sizes; torch-free.
//
// Layout: a pool of P pages of S token slots; slot s of page p holds one latent ckv[p][s] (Dc
// values) and one rotary key krope[p][s] (Dr values), shared by every query head. Sequence b owns
// the pages block_table[b][0..], in order: its position `pos` lives at page
// block_table[b][pos / S], slot pos % S (S any size 1 .. 256).
#pragma once

#include <cstdint>

#include "../common/scalar_type.h"

namespace astr::kernels {

// Query rows: new token i of sequence b is row query_start_loc[b] + i (decode: row b, the
// sequence's one new token) and sits at position p = seq_lens[b] - q_len(b) + i; it sees
// positions pos < seq_lens[b], and pos <= p when is_causal.
//   score(pos) = scale * (q_nope[row, h] . ckv(pos) + q_rope[row, h] . krope(pos))
//   out[row, h] = sum over the visible pos of softmax(score)(pos) * ckv(pos)
// An FP8 latent reads ckv(pos) = stored.float() * ckv_scale[0]. A row that sees nothing is written
// as zeros with lse -inf (decode: a length of 0 is a padding slot); a row with a NaN or inf score
// (a NaN or inf in its query or in a position it sees) is NaN, out and lse, with or without splits.
//
// Bad metadata is never followed outside the tensors (page ids outside [0, P) are not read;
// lengths are clamped to the block table) and the rows it concerns are NaN, as the paged
// attention kernels poison them (paged_attention/params.h): a sequence whose length exceeds its
// block-table row or is below its new tokens, or whose pages (those its length uses) include an
// id outside the pool; in a prefill, a sequence with more new tokens than max_query_len, and every
// row when query_start_loc does not run from 0 to T without decreasing.
struct MlaAttentionParams {
  const void* q_nope;           // [T, H, Dc], q_dtype, last dim contiguous
  int64_t q_nope_stride_token;  // elements
  int64_t q_nope_stride_head;   // elements
  const void* q_rope;           // [T, H, Dr], q_dtype, last dim contiguous
  int64_t q_rope_stride_token;  // elements
  int64_t q_rope_stride_head;   // elements
  ScalarType q_dtype;           // kBFloat16 or kFloat16; also the output's and krope's

  const void* ckv_cache;      // [P, S, Dc], last dim contiguous, rows 16-byte aligned
  int64_t ckv_stride_page;    // elements
  int64_t ckv_stride_slot;    // elements
  ScalarType ckv_dtype;       // q_dtype, or kFloat8E4M3
  const float* ckv_scale;     // [1] float32 for an FP8 latent, else null
  const void* krope_cache;    // [P, S, Dr], q_dtype, last dim contiguous, rows 16-byte aligned
  int64_t krope_stride_page;  // elements
  int64_t krope_stride_slot;  // elements
  int num_pages;              // P
  int page_size;              // S

  const int32_t* block_table;      // [B, W] int32
  int64_t block_table_stride;      // elements between block_table[b] and block_table[b + 1]
  int block_table_width;           // W
  const int32_t* seq_lens;         // [B] int32, cached + new tokens
  const int32_t* query_start_loc;  // [B + 1] int32 (a prefill's; a decode ignores it)
  int max_query_len;               // a prefill's host bound on any sequence's new tokens; 1 decode
  bool decode;                     // one new token per sequence: row b is sequence b's

  void* out;                 // [T, H, Dc], q_dtype, written
  int64_t out_stride_token;  // elements
  int64_t out_stride_head;   // elements
  float* lse;                // [T, H] float32 natural log of each row's denominator, or null
  int64_t lse_stride_token;  // elements

  int num_seqs;    // B
  int num_tokens;  // T
  int num_heads;   // H
  bool is_causal;
  float scale;
};

// The tensor-core kernel's split workspace (plan.num_splits > 1; else null): split s of packed
// row r = token * H + head writes its output normalised by its own softmax sum and its log2-sum-
// exp (-inf: it saw nothing; NaN: poisoned), which the merge kernel combines into out and lse.
struct MlaSplitWorkspace {
  float* out = nullptr;  // [num_splits, T * H, Dc] float32
  float* lse = nullptr;  // [num_splits, T * H] float32, log2 units
};

// ckv_cache[slot / S, slot % S, :] = ckv[t, :] and krope_cache[slot / S, slot % S, :] = krope[t, :]
// for every token t whose slot_mapping[t] = slot is in [0, P * S); other slots (negative:
// padding) skip the token. An FP8 latent stores fp8(clamp(ckv[t, :] / ckv_scale[0], -448, 448)),
// rounded to nearest even (torch's cast after the clamp).
struct AppendMlaParams {
  const void* ckv;             // [T, Dc], ckv_dtype, last dim contiguous, rows 16-byte aligned
  int64_t ckv_stride_token;    // elements
  ScalarType ckv_dtype;        // the pool's, or (FP8 pool) bf16 / fp16 / fp32
  const void* krope;           // [T, Dr], krope_dtype, last dim contiguous, rows 16-byte aligned
  int64_t krope_stride_token;  // elements
  ScalarType krope_dtype;      // the krope pool's
  void* ckv_cache;             // [P, S, Dc]
  int64_t ckv_cache_stride_page, ckv_cache_stride_slot;  // elements
  ScalarType ckv_cache_dtype;                            // ckv_dtype, or kFloat8E4M3
  const float* ckv_scale;                                // [1] float32 for an FP8 pool, else null
  void* krope_cache;                                     // [P, S, Dr]
  int64_t krope_cache_stride_page, krope_cache_stride_slot;  // elements
  const int32_t* slot_mapping;  // [T] int32, page * S + offset; negative = skip the token
  int num_tokens;               // T
  int latent_dim;               // Dc; a row of ckv and of the pool a multiple of 16 bytes
  int rope_dim;                 // Dr; a row of krope a multiple of 16 bytes
  int page_size;                // S
  int64_t num_pages;            // P
};

}  // namespace astr::kernels
