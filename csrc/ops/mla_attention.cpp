// astr::mla_attention: tensors -> CallDescription -> resolver -> backend, as astr::attention.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <tuple>

#include "backends/mla.h"
#include "dispatch/resolver.h"
#include "ops/backend_selection.h"
#include "ops/mla_attention_args.h"
#include "ops/ops.h"
#include "ops/resolved_call.h"
#include "support/check.h"

namespace astr {

namespace {

using dispatch::Backend;
using dispatch::CallDescription;
using dispatch::Decision;

const Decision& decide(const MlaAttentionArgs& args, const CallDescription& call) {
  return dispatch::resolve_backend_cached(call, call_selection(args.backend, args.backend_source),
                                          dispatch::BackendStatusTable::instance());
}

AttentionResult run_mla_attention(MlaAttentionArgs& args) {
  const CallDescription call = validate_and_describe_mla(args);
  const Decision& decision = decide(args, call);
  ASTR_CHECK(decision.chosen.has_value(), decision.error);
  report_fallback("astr.mla_attention", decision, call);
  // A choice the caller did not pass is read at trace time: the graph checks it at run time.
  if (!args.backend && args.backend_source == 0 && is_traced(args.q_nope)) {
    record_trace_state(args.q_nope);
  }
  // max_query_len may be any upper bound; the call's token count is one too, and the backends
  // size buffers by the bound (unchanged while the token count is symbolic).
  if (const auto tokens = args.q_nope.sym_size(0).maybe_as_int()) {
    args.max_query_len = std::min<int64_t>(args.max_query_len, std::max<int64_t>(*tokens, 1));
  }
  if (args.seq_lens.sym_size(0) == 0) {
    // No sequence, so no query token (validated): the answer is empty, whatever the backend.
    // Tied to the queries so that autograd sees it.
    const at::Tensor& q = args.q_nope;
    const at::Tensor out =
        at::zeros({0, q.size(1), q.size(2)}, q.options()) + (q.sum() + args.q_rope.sum()) * 0;
    return {out, at::empty({0, q.size(1)}, q.options().dtype(at::kFloat))};
  }
  switch (*decision.chosen) {
    case Backend::kCuda:
      return cuda_mla(args);
    case Backend::kTorchNative:
      return torch_native_mla(args);
    case Backend::kFlash:
      break;  // the capability rules never choose it for a latent call
  }
  ASTR_CHECK(false, "astr.mla_attention: backend ", dispatch::backend_name(*decision.chosen),
             " has no latent attention");
}

}  // namespace

at::Tensor mla_attention(const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS) {
  MlaAttentionArgs args(q_nope ASTR_MLA_ATTENTION_FORWARDED, /*return_lse=*/false);
  return std::get<0>(run_mla_attention(args));
}

std::tuple<at::Tensor, at::Tensor> mla_attention_with_lse(
    const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS, bool return_lse) {
  ASTR_CHECK_VALUE(return_lse,
                   "return_lse: mla_attention.lse returns (out, lse); call mla_attention without "
                   "return_lse for out alone");
  MlaAttentionArgs args(q_nope ASTR_MLA_ATTENTION_FORWARDED, /*return_lse=*/true);
  return run_mla_attention(args);
}

std::string explain_mla(const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS, bool return_lse) {
  const MlaAttentionArgs args(q_nope ASTR_MLA_ATTENTION_FORWARDED, return_lse);
  return decide(args, validate_and_describe_mla(args)).to_json();
}

}  // namespace astr
