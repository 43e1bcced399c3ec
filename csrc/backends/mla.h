// The backends of astr::mla_attention as the resolver calls them. Arguments are already validated
// (ops/validate_mla_attention.cpp). Each returns (out [T,H,Dc] in q's dtype, lse [T,H] float32);
// lse is defined only when args.return_lse.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "ops/mla_attention_args.h"

namespace astr {

using AttentionResult = std::tuple<at::Tensor, at::Tensor>;

// torch_native: composite ATen on any device, differentiable in the queries; gathers the
// sequences' latent pages and computes in float32 (float64 for float64 queries). The reference.
AttentionResult torch_native_mla(const MlaAttentionArgs& args);

// cuda: astr::cuda_mla_attention (CUDA key: backends/cuda/mla_attention.cu), reached through the
// dispatcher so that torch.compile traces its fake kernel.
AttentionResult cuda_mla(const MlaAttentionArgs& args);

}  // namespace astr
