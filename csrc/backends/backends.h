// The three backends as the resolver calls them. Arguments are already validated
// (csrc/describe_call.cpp). Each returns (out, lse): lse is defined only when args.return_lse.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "ops/attention_args.h"

namespace astr {

using AttentionResult = std::tuple<at::Tensor, at::Tensor>;

// torch_native: composite ATen over every device, differentiable; SDPA for plain calls, scores
// written out for the variants (torch_native.cpp). The reference.
AttentionResult torch_native_dense(const AttentionArgs& args);  // -> [B,Lq,Hq,Dv], [B,Lq,Hq]
AttentionResult torch_native_paged(const AttentionArgs& args);  // -> [T,Hq,Dv], [T,Hq]

// cuda: our kernels (astr::cuda_paged_attention, CUDA key), paged calls only.
AttentionResult cuda_paged(const AttentionArgs& args);  // -> [T,Hq,D], [T,Hq]

// flash: the flash-attn package's ops, reached through the dispatcher.
AttentionResult flash_dense(const AttentionArgs& args);  // -> [B,Lq,Hq,D], [B,Lq,Hq]
AttentionResult flash_paged(const AttentionArgs& args);  // -> [T,Hq,D], [T,Hq]

// The paged reference's poison, with tensor ops (no host sync): [B] bool, false for a sequence
// whose metadata is out of range (a page id outside the pool among the pages its length uses, a
// length past its block-table row, negative or below its new tokens, new tokens negative or past
// max_q) and, given query_start_loc (a prefill), for every sequence unless it runs from 0 to
// `tokens`. table long [B, W], seq_len and q_len long [B].
at::Tensor sequences_in_range(const at::Tensor& table, const at::Tensor& seq_len,
                              const at::Tensor& q_len, int64_t page_size, int64_t num_pages,
                              int64_t max_q, const std::optional<at::Tensor>& query_start_loc,
                              int64_t tokens);

}  // namespace astr
