// One attention call's arguments, validated, as the backends receive them.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "dispatch/call_description.h"

namespace astr {

struct AttentionArgs {
  const at::Tensor& q;                         // dense [B,Lq,Hq,D] | paged [T,Hq,D]
  const std::optional<at::Tensor>& k;          // dense [B,Lk,Hkv,D]
  const std::optional<at::Tensor>& v;          // dense [B,Lk,Hkv,Dv]
  const std::optional<at::Tensor>& attn_mask;  // dense: broadcastable to [B,Hq,Lq,Lk]; paged [T,K]
  bool is_causal;
  std::optional<double> scale;
  const std::optional<at::Tensor>& k_cache;          // [P,S,Hkv,D]
  const std::optional<at::Tensor>& v_cache;          // [P,S,Hkv,Dv]
  const std::optional<at::Tensor>& block_table;      // int32 [B,W]
  const std::optional<at::Tensor>& seq_lens;         // int32 [B], cached + new tokens
  const std::optional<at::Tensor>& query_start_loc;  // int32 [B+1]; optional for decode
  int64_t max_query_len;
  dispatch::Mode mode;
  // Variants (params.h in csrc/kernels/paged_attention has the definitions).
  int64_t window_left;                     // -1: no window
  std::optional<double> softcap;           // > 0 when set
  const std::optional<at::Tensor>& sinks;  // float32 [Hq]
  bool return_lse;
  const std::optional<at::Tensor>& k_scale;  // FP8 cache: float32 [Hkv]
  const std::optional<at::Tensor>& v_scale;

  bool paged() const { return k_cache.has_value(); }
  // The softcap as the kernels take it: 0 when off.
  double softcap_value() const { return softcap.value_or(0.0); }
  bool decode() const { return paged() && mode == dispatch::Mode::kDecode; }
  int64_t head_dim() const { return q.size(-1); }
  double resolved_scale() const;
};

// Parses `mode` ("prefill", "decode" or None) naming the argument on error.
dispatch::Mode parse_mode(std::optional<c10::string_view> mode);

// Checks shapes, dtypes and devices (and, for CPU tensors, the paged metadata's values) with
// errors that name the argument; then describes the call for the resolver.
dispatch::CallDescription validate_and_describe(const AttentionArgs& args);

// The resolver's description from q alone (check_backend): kv heads assumed equal to q heads
// unless a cache says otherwise.
dispatch::CallDescription describe_form(const at::Tensor& q,
                                        const std::optional<at::Tensor>& k_cache,
                                        const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                        dispatch::Mode mode);

}  // namespace astr
