// The three backends as the resolver calls them. Arguments are already validated
// (csrc/describe_call.cpp). Each returns (out, lse): lse is defined only when args.return_lse.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace astr
