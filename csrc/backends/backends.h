// The three backends as the resolver calls them. Arguments are already validated
// (csrc/describe_call.cpp).
#pragma once

#include <ATen/ATen.h>

#include "../attention_args.h"

namespace astr {

// torch_native: composite over at::scaled_dot_product_attention, every device, differentiable.
at::Tensor torch_native_dense(const AttentionArgs& args);  // -> [B,Lq,Hq,Dv]
at::Tensor torch_native_paged(const AttentionArgs& args);  // -> [T,Hq,Dv]

// cuda: our kernels (astr::cuda_paged_attention, CUDA key), paged calls only.
at::Tensor cuda_paged(const AttentionArgs& args);  // -> [T,Hq,D]

// flash: the flash-attn package's ops, reached through the dispatcher.
at::Tensor flash_dense(const AttentionArgs& args);  // -> [B,Lq,Hq,D]
at::Tensor flash_paged(const AttentionArgs& args);  // -> [T,Hq,D]

}  // namespace astr
