// The argument checks of astr::append_kv that every kernel of the op runs before it writes
// anything: the CPU and CUDA bindings, and the Meta kernel (which fake tensors run while
// torch.compile traces).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace astr {

// The most slots a pool may hold: slot_mapping is int32 (PagedKVCache refuses larger pools too).
constexpr int64_t kMaxPoolSlots = INT32_MAX;

// k [T,Hkv,D], v [T,Hkv,Dv], k_cache [P,S,Hkv,D], v_cache [P,S,Hkv,Dv], slot_mapping int32 [T]:
// one device (k's), matching dtypes and shapes; FP8 pools (float8_e4m3fn / e5m2) take k and v of
// a float dtype and need k_scale, v_scale (float32 [Hkv]), which other pools refuse. Raises naming
// the argument. Sizes are read symbolically, so fake tensors with dynamic shapes pass through.
// Values are not read (the bindings check what their device can check without a sync).
void check_append_kv_args(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                          const std::optional<at::Tensor>& k_scale,
                          const std::optional<at::Tensor>& v_scale);

// The pool `cache` ([P, S, ...], named `cache_name`) holds at most kMaxPoolSlots slots, and
// slot_mapping is int32 [tokens]. Sizes are read symbolically. Raises naming the argument.
void check_slot_mapping(const at::Tensor& slot_mapping, const at::Tensor& cache,
                        const char* cache_name, const c10::SymInt& tokens);

// Every slot in `kept_slots` (int64, the non-negative entries of slot_mapping) lies in `cache`
// ([P, S, ...]). Reads the values (a host synchronisation for a device tensor).
void check_slots_in_pool(const at::Tensor& kept_slots, const at::Tensor& cache);

// The pools are not the same memory (v_cache a view of k_cache's very elements): every write into
// one would land in the other. Reads no values. Raises naming v_cache.
void check_pools_apart(const at::Tensor& k_cache, const at::Tensor& v_cache);

// Value checks that read the tensors (on a GPU a host synchronisation: the CUDA kernel runs them
// in the checked mode only, kernel_settings.h): no slot appears twice among the written tokens
// (one step writes each slot once; which write would win is unspecified), and FP8 scales are
// positive and finite (x / 0 would store inf or NaN). Raises naming the argument.
void check_append_kv_values(const at::Tensor& slot_mapping,
                            const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale);

// Raises naming `name` unless every element of the float32 `scale` is positive and finite. Reads
// the values (a host synchronisation for a device tensor).
void check_positive_finite_scale(const at::Tensor& scale, const char* name);

}  // namespace astr
