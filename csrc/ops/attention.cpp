// astr::attention and its companions: tensors -> CallDescription -> resolver -> backend.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include "backends/backends.h"
#include "dispatch/backend_status.h"
#include "dispatch/capability.h"
#include "dispatch/resolver.h"
#include "ops/attention_args.h"
#include "ops/backend_selection.h"
#include "ops/ops.h"
#include "ops/resolved_call.h"
#include "support/check.h"
#include "support/python_warnings.h"

namespace astr {

using dispatch::Backend;
using dispatch::BackendStatusTable;
using dispatch::CallDescription;
using dispatch::Decision;

// An implicit choice that skipped a backend which is present: say so once per distinct reason.
// Training calls skipping the cache-only cuda kernels are by design, not a slow path. Marked as
// said only once the warning was issued: one a filter turned into an error is raised again.
void report_fallback(const char* op, const Decision& decision, const CallDescription& call) {
  if (!decision.fell_back || !decision.chosen || decision.fallback_reported) return;
  std::string skipped;
  for (Backend backend : dispatch::kAllBackends) {
    if (backend == *decision.chosen) break;
    const auto& reasons = decision.reasons[static_cast<int>(backend)];
    bool by_design = backend == Backend::kCuda && !call.has_kv_cache &&
                     decision.selection.source == dispatch::SelectionSource::kDefault;
    if (reasons.empty() || by_design) continue;
    skipped += std::string(" ") + dispatch::backend_name(backend) + " (" + reasons.front() + ")";
  }
  const std::string key =
      std::string(op) + " -> " + dispatch::backend_name(*decision.chosen) + skipped;
  static std::mutex mutex;
  static std::set<std::string> reported;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (skipped.empty() || reported.count(key)) {
      decision.fallback_reported = true;
      return;
    }
  }
  const std::string requested =
      decision.selection.name.empty() ? std::string("default") : decision.selection.name;
  warn_in_python(std::string(op) + ": using " + dispatch::backend_name(*decision.chosen) +
                 " (requested: " + requested + ", " +
                 dispatch::selection_source_name(decision.selection.source) + "); skipped" +
                 skipped);
  std::lock_guard<std::mutex> lock(mutex);
  reported.insert(key);
  decision.fallback_reported = true;
}

// True while torch.compile traces: q is a fake or functional tensor.
bool is_traced(const at::Tensor& q) {
  const c10::DispatchKeySet keys = q.key_set();
  return keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize);
}

// Records astr::check_trace_state in the graph being traced (see ops.h).
void record_trace_state(const at::Tensor& q) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("astr::check_trace_state", "")
                             .typed<void(const at::Tensor&, c10::string_view, int64_t)>();
  const auto [name, source] = selected_backend();
  op.call(q, c10::string_view(name.data(), name.size()), source);
}

namespace {

std::string describe_state(const std::string& name, int64_t source) {
  switch (static_cast<dispatch::SelectionSource>(source)) {
    case dispatch::SelectionSource::kContext:
      return "context:" + name;
    case dispatch::SelectionSource::kEnvironment:
      return "environment:" + name;
    default:
      return "no context and no ASTR_BACKEND";
  }
}

bool is_empty_batch(const at::Tensor& seq_lens) {
  const auto batch = seq_lens.sym_size(0).maybe_as_int();
  return batch && *batch == 0;
}

// max_query_len may be any upper bound on the new tokens of one sequence; the call's token count
// is one too, and the backends size buffers by the bound: a huge value would otherwise fail in
// the allocator. Unchanged while the token count is symbolic (torch.compile traces).
int64_t bounded_max_query_len(const at::Tensor& q, const std::optional<at::Tensor>& k_cache,
                              int64_t max_query_len) {
  if (!k_cache || q.dim() != 3) return max_query_len;
  const auto tokens = q.sym_size(0).maybe_as_int();
  return tokens ? std::min(max_query_len, std::max<int64_t>(*tokens, 1)) : max_query_len;
}

const Decision& decide(const AttentionArgs& args, const CallDescription& call) {
  return dispatch::resolve_backend_cached(call, call_selection(args.backend, args.backend_source),
                                          BackendStatusTable::instance());
}

AttentionResult run_attention(AttentionArgs& args) {
  args.max_query_len = bounded_max_query_len(args.q, args.k_cache, args.max_query_len);
  const CallDescription call = validate_and_describe(args);
  const Decision& decision = decide(args, call);
  ASTR_CHECK(decision.chosen.has_value(), decision.error);
  report_fallback("astr.attention", decision, call);
  // A choice the caller did not pass is read at trace time: the graph checks it at run time.
  if (!args.backend && args.backend_source == 0 && is_traced(args.q)) record_trace_state(args.q);
  if (args.paged() && is_empty_batch(*args.seq_lens)) {
    // No sequence, so no query token (validated): the answer is empty, whatever the backend
    // (whose gathers size buffers by the batch). Tied to q so that autograd sees it.
    const at::Tensor& q = args.q;
    const at::Tensor out =
        at::zeros({0, q.size(1), args.v_cache->size(3)}, q.options()) + q.sum() * 0;
    return {out, at::empty({0, q.size(1)}, q.options().dtype(at::kFloat))};
  }
  switch (*decision.chosen) {
    case Backend::kCuda:
      return cuda_paged(args);
    case Backend::kFlash:
      return args.paged() ? flash_paged(args) : flash_dense(args);
    case Backend::kTorchNative:
      return args.paged() ? torch_native_paged(args) : torch_native_dense(args);
  }
  ASTR_CHECK(false, "unreachable backend");
}

}  // namespace

at::Tensor attention(const at::Tensor& q ASTR_ATTENTION_PARAMS) {
  AttentionArgs args(q ASTR_ATTENTION_FORWARDED, /*return_lse=*/false);
  return std::get<0>(run_attention(args));
}

std::tuple<at::Tensor, at::Tensor> attention_with_lse(const at::Tensor& q ASTR_ATTENTION_PARAMS,
                                                      bool return_lse) {
  AttentionArgs args(q ASTR_ATTENTION_FORWARDED, return_lse);
  auto [out, lse] = run_attention(args);
  // return_lse=False: no LSE is computed, and the schema's second tensor is empty.
  if (!return_lse) lse = at::empty({0}, q.options().dtype(at::kFloat));
  return {out, lse};
}

std::string explain(const at::Tensor& q ASTR_ATTENTION_PARAMS, bool return_lse) {
  AttentionArgs args(q ASTR_ATTENTION_FORWARDED, return_lse);
  // As run_attention bounds it, so that explain accepts what attention accepts (a tree mask's
  // width is checked against the bound).
  args.max_query_len = bounded_max_query_len(args.q, args.k_cache, args.max_query_len);
  return decide(args, validate_and_describe(args)).to_json();
}

std::string check_backend(c10::string_view backend, const at::Tensor& q,
                          const std::optional<at::Tensor>& k_cache,
                          const std::optional<at::Tensor>& attn_mask, bool is_causal,
                          std::optional<c10::string_view> mode, bool placement,
                          const std::optional<at::Tensor>& v_cache) {
  const std::string name(backend.data(), backend.size());
  const auto parsed = dispatch::parse_backend(name);
  ASTR_CHECK_VALUE(parsed.has_value(), "backend: unknown attention backend '", name,
                   "' (valid: ", dispatch::valid_backend_names(), ")");
  const CallDescription call =
      describe_form(q, k_cache, attn_mask, is_causal, parse_mode(mode), v_cache);
  const auto reasons =
      dispatch::rejection_reasons(*parsed, call, BackendStatusTable::instance().get(*parsed),
                                  placement ? dispatch::Checks::kAll : dispatch::Checks::kForm);
  std::string text;
  for (const auto& reason : reasons) text += reason + "\n";
  return text;
}

void check_trace_state(const at::Tensor& q, c10::string_view backend, int64_t backend_source) {
  if (is_traced(q) || q.is_meta()) return;  // tracing: the state is the one being recorded
  const auto [name, source] = selected_backend();
  const std::string traced(backend.data(), backend.size());
  if (name == traced && source == backend_source) return;
  ASTR_CHECK(false, "astr.attention: this compiled graph chose its attention backend under ",
             describe_state(traced, backend_source), ", but now runs under ",
             describe_state(name, source),
             ". torch.compile does not guard direct torch.ops.astr.attention (or mla_attention) "
             "calls on the backend context or ASTR_BACKEND: call astrai.extension.attention (or "
             "mla_attention; they recompile) or pass backend=.... Retracing "
             "(torch._dynamo.reset()) helps only if the graph was "
             "traced in this process: AOTAutograd's on-disk cache keys graphs on their ops, not "
             "on this choice (torch._functorch.config.enable_autograd_cache = False turns it "
             "off).");
}

}  // namespace astr
