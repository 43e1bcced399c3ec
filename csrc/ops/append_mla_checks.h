// The argument checks of astr::append_mla that every kernel of the op runs before it writes
// anything: the CPU and CUDA bindings, and the Meta kernel (which fake tensors run while
// torch.compile traces).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace astr {

// ckv [T,Dc], krope [T,Dr], ckv_cache [P,S,Dc], krope_cache [P,S,Dr], slot_mapping int32 [T]: one
// device (ckv's), matching shapes; ckv_cache holds ckv's dtype, or float8_e4m3fn (then ckv is a
// float dtype, quantized on write with ckv_scale, float32 [1], which other pools refuse);
// krope_cache holds krope's dtype (never FP8); the pools hold at most 2^31 - 1 slots. Sizes are
// read symbolically (fake tensors with dynamic shapes pass through); no value is read. Raises
// naming the argument.
void check_append_mla_args(const at::Tensor& ckv, const at::Tensor& krope,
                           const at::Tensor& ckv_cache, const at::Tensor& krope_cache,
                           const at::Tensor& slot_mapping,
                           const std::optional<at::Tensor>& ckv_scale);

// The pools are not the same memory (every write into one would land in the other). Reads no
// values; not for meta tensors (they have no memory to compare). Raises naming krope_cache.
void check_mla_pools_apart(const at::Tensor& ckv_cache, const at::Tensor& krope_cache);

// The checks that read values (on a GPU a host synchronisation: the CUDA kernel runs them in the
// checked mode only): no slot written twice, and a positive finite ckv_scale.
void check_append_mla_values(const at::Tensor& slot_mapping,
                             const std::optional<at::Tensor>& ckv_scale);

}  // namespace astr
