// What one sequence's metadata gives the latent-attention kernels: its query rows, the positions
// each sees and whether it is poisoned (params.h), read once and clamped to what can be read.
// Shared by mla_attention_kernel.cu and mla_tensor_core_kernel.cu so that both apply one rule.
#pragma once

#include <cstdint>

#include "params.h"

namespace astr::kernels {

struct SequenceRows {
  bool poisoned;    // the sequence's metadata is invalid: its rows are NaN (out and lse)
  int first_token;  // the row of q and out of its new token 0
  int num_rows;     // its rows in q and out: 1 for a decode (a padding slot too), q_len otherwise
  int q_len;        // the new tokens the positions count: num_rows, or 0 for a decode padding slot
  int seq_len;      // clamped to [0, block table width * S]
  bool is_causal;

  // New token `index` sits at position seq_len - q_len + index and sees positions [0, kv_end).
  __device__ __forceinline__ int kv_end(int index) const {
    const int64_t position = static_cast<int64_t>(seq_len) - q_len + index;
    const int64_t end = is_causal ? min(static_cast<int64_t>(seq_len), position + 1) : seq_len;
    return static_cast<int>(max(end, int64_t{0}));
  }
};

__device__ __forceinline__ SequenceRows sequence_rows(const MlaAttentionParams& p, int seq) {
  SequenceRows rows{};
  const int64_t capacity = static_cast<int64_t>(p.block_table_width) * p.page_size;
  const int64_t raw_len = p.seq_lens[seq];
  rows.is_causal = p.is_causal;
  if (p.decode) {
    // A length of 0 is a padding slot: its row sees nothing (zeros out).
    rows.first_token = seq;
    rows.num_rows = 1;
    rows.q_len = raw_len > 0 ? 1 : 0;
    rows.poisoned = raw_len < 0 || raw_len > capacity;
  } else {
    const int64_t start = p.query_start_loc[seq];
    const int64_t end = p.query_start_loc[seq + 1];
    const int64_t q_start = min(max(start, int64_t{0}), static_cast<int64_t>(p.num_tokens));
    const int64_t q_end = min(max(end, q_start), static_cast<int64_t>(p.num_tokens));
    rows.first_token = static_cast<int>(q_start);
    rows.num_rows = rows.q_len = static_cast<int>(q_end - q_start);
    rows.poisoned = start < 0 || end < start || end > p.num_tokens ||
                    end - start > p.max_query_len || raw_len < end - start || raw_len > capacity;
  }
  rows.seq_len = static_cast<int>(min(max(raw_len, int64_t{0}), capacity));
  return rows;
}

}  // namespace astr::kernels
