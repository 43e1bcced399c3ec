// The argument checks of astr::append_kv that every kernel of the op runs before it writes
// anything: the CPU and CUDA bindings, and the Meta kernel (which fake tensors run while
// torch.compile traces).
#pragma once

#include <ATen/ATen.h>

namespace astr {

// k [T,Hkv,D], v [T,Hkv,Dv], k_cache [P,S,Hkv,D], v_cache [P,S,Hkv,Dv], slot_mapping int32 [T]:
// one device (k's), matching dtypes and shapes; FP8 pools (float8_e4m3fn / e5m2) take k and v of
// a float dtype and need k_scale, v_scale (float32 [Hkv]), which other pools refuse. Raises naming
// the argument. Sizes are read symbolically, so fake tensors with dynamic shapes pass through.
// Values are not read (the bindings check what their device can check without a sync).
void check_append_kv_args(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                          const std::optional<at::Tensor>& k_scale,
                          const std::optional<at::Tensor>& v_scale);

}  // namespace astr
