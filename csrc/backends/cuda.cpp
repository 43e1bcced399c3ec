// The cuda backend as the resolver sees it: a call through the dispatcher to
// astr::cuda_paged_attention, whose CUDA kernel lives in cuda_paged_attention.cu.
#include <ATen/core/dispatch/Dispatcher.h>

#include "backends/backends.h"

namespace astr {

AttentionResult cuda_paged(const AttentionArgs& a) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("astr::cuda_paged_attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, int64_t, bool, const std::optional<at::Tensor>&,
              bool, double, int64_t, double, const std::optional<at::Tensor>&, bool,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  // Decode needs no query_start_loc; the kernel ignores it, so any int32 tensor will do.
  const at::Tensor starts = a.query_start_loc ? *a.query_start_loc : *a.seq_lens;
  auto [out, lse] = op.call(a.q, *a.k_cache, *a.v_cache, *a.block_table, *a.seq_lens, starts,
                            a.decode() ? 1 : a.max_query_len, a.decode(), a.attn_mask, a.is_causal,
                            a.resolved_scale(), a.window_left, a.softcap_value(), a.sinks,
                            a.return_lse, a.k_scale, a.v_scale);
  return {out, a.return_lse ? lse : at::Tensor()};
}

}  // namespace astr
