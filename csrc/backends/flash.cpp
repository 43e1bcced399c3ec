// The flash backend: astr::flash_dense / astr::flash_paged, whose kernels the Python flash probe
// registers (wrapping the flash-attn package) once it has imported the package.
#include <ATen/core/dispatch/Dispatcher.h>

#include "backends/backends.h"
#include "support/check.h"

namespace astr {

namespace {

const c10::OperatorHandle& flash_op(const char* name) {
  const c10::OperatorHandle& op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  // FlashAttention-2/3 register a composite kernel, FlashAttention-4 a CUDA one.
  ASTR_CHECK(op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
                 op.hasKernelForDispatchKey(c10::DispatchKey::CUDA),
             "flash backend: ", name,
             " has no implementation; astrai.extension registers it when it finds flash-attn");
  return op;
}

}  // namespace

AttentionResult flash_dense(const AttentionArgs& a) {
  static const auto op = flash_op("astr::flash_dense")
                             .typed<std::tuple<at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                                 double, int64_t, double, bool)>();
  auto [out, lse] = op.call(a.q, *a.k, *a.v, a.is_causal, a.resolved_scale(), a.window_left,
                            a.softcap_value(), a.return_lse);
  return {out, a.return_lse ? lse : at::Tensor()};
}

AttentionResult flash_paged(const AttentionArgs& a) {
  static const auto op = flash_op("astr::flash_paged")
                             .typed<std::tuple<at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                 bool, bool, double, int64_t, double, bool)>();
  const at::Tensor starts = a.query_start_loc ? *a.query_start_loc : *a.seq_lens;
  auto [out, lse] = op.call(a.q, *a.k_cache, *a.v_cache, *a.block_table, *a.seq_lens, starts,
                            a.decode() ? 1 : a.max_query_len, a.decode(), a.is_causal,
                            a.resolved_scale(), a.window_left, a.softcap_value(), a.return_lse);
  return {out, a.return_lse ? lse : at::Tensor()};
}

}  // namespace astr
