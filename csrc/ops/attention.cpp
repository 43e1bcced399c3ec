// astr::attention and its companions: tensors -> CallDescription -> resolver -> backend.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>

#include "backends/backends.h"
#include "dispatch/backend_status.h"
#include "dispatch/capability.h"
#include "dispatch/override_stack.h"
#include "dispatch/resolver.h"
#include "ops/attention_args.h"
#include "ops/ops.h"
#include "support/check.h"
#include "support/python_warnings.h"

namespace astr {

namespace {

using dispatch::Backend;
using dispatch::BackendStatusTable;
using dispatch::CallDescription;
using dispatch::Decision;
using dispatch::OverrideStack;
using dispatch::Selection;

// Through Python's warnings module (see python_warnings.h); never called with a lock held.
void warn(const std::string& message) { warn_in_python(message); }

std::string to_string(const std::optional<c10::string_view>& text) {
  return text ? std::string(text->data(), text->size()) : std::string();
}

std::string environment_backend() {
  const char* value = std::getenv("ASTR_BACKEND");
  return value ? std::string(value) : std::string();
}

const Decision& decide(const CallDescription& call, const std::optional<c10::string_view>& backend,
                       const std::optional<c10::string_view>& observed = std::nullopt) {
  std::optional<std::string> context;
  std::string environment;
  if (!observed) {
    context = OverrideStack::current().top();
    environment = environment_backend();
  } else {  // "context:NAME", "environment:NAME" or "": what the caller saw
    const std::string text = to_string(observed);
    const auto colon = text.find(':');
    const std::string source = text.substr(0, colon == std::string::npos ? 0 : colon);
    const std::string name = colon == std::string::npos ? std::string() : text.substr(colon + 1);
    ASTR_CHECK_VALUE(text.empty() || source == "context" || source == "environment",
                     "selection: expected \"context:NAME\", \"environment:NAME\" or \"\", got \"",
                     text, "\"");
    // A context names a backend (the stack validates its pushes; this string is the caller's).
    // An unknown environment name is what ASTR_BACKEND may hold: warned about and ignored.
    ASTR_CHECK_VALUE(source != "context" || dispatch::parse_backend(name).has_value() ||
                         dispatch::is_python_backend_marker(name),
                     "selection: \"", text, "\" names no backend (expected \"context:NAME\" with ",
                     "NAME one of ", dispatch::valid_backend_names(), ", or python:LABEL)");
    context = source == "context" ? std::optional<std::string>(name) : std::nullopt;
    environment = source == "environment" ? name : std::string();
  }
  Selection selection = dispatch::select_backend(to_string(backend), context, environment, &warn);
  return dispatch::resolve_backend_cached(call, selection, BackendStatusTable::instance());
}

// An implicit choice that skipped a backend which is present: say so once per distinct reason.
// Training calls skipping the cache-only cuda kernels are by design, not a slow path.
void report_fallback(const Decision& decision, const CallDescription& call) {
  if (!decision.fell_back || !decision.chosen || decision.fallback_reported) return;
  decision.fallback_reported = true;
  std::string key = std::string("-> ") + dispatch::backend_name(*decision.chosen);
  std::string skipped;
  for (Backend backend : dispatch::kAllBackends) {
    if (backend == *decision.chosen) break;
    const auto& reasons = decision.reasons[static_cast<int>(backend)];
    bool by_design = backend == Backend::kCuda && !call.has_kv_cache &&
                     decision.selection.source == dispatch::SelectionSource::kDefault;
    if (reasons.empty() || by_design) continue;
    skipped += std::string(" ") + dispatch::backend_name(backend) + " (" + reasons.front() + ")";
  }
  if (skipped.empty()) return;
  key += skipped;
  static std::mutex mutex;
  static std::set<std::string> reported;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!reported.insert(key).second) return;
  }
  const std::string requested =
      decision.selection.name.empty() ? std::string("default") : decision.selection.name;
  warn(std::string("astr.attention: using ") + dispatch::backend_name(*decision.chosen) +
       " (requested: " + requested + ", " +
       dispatch::selection_source_name(decision.selection.source) + "); skipped" + skipped);
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
                             .typed<void(const at::Tensor&, c10::string_view)>();
  const std::string state = selected_backend();
  op.call(q, c10::string_view(state.data(), state.size()));
}

std::string describe_state(const std::string& state) {
  return state.empty() ? std::string("no context and no ASTR_BACKEND") : state;
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

}  // namespace

namespace {

// The op's arguments as one AttentionArgs, which refers to them: call it where they live.
AttentionArgs make_args(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale,
    const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& seq_lens,
    const std::optional<at::Tensor>& query_start_loc, int64_t max_query_len,
    std::optional<c10::string_view> mode, int64_t window_left, std::optional<double> softcap,
    const std::optional<at::Tensor>& sinks, bool return_lse,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  return {q,
          k,
          v,
          attn_mask,
          is_causal,
          scale,
          k_cache,
          v_cache,
          block_table,
          seq_lens,
          query_start_loc,
          max_query_len,
          parse_mode(mode),
          window_left,
          softcap,
          sinks,
          return_lse,
          k_scale,
          v_scale};
}

AttentionResult run_attention(const AttentionArgs& args, std::optional<c10::string_view> backend,
                              std::optional<c10::string_view> selection) {
  const CallDescription call = validate_and_describe(args);
  const Decision& decision = decide(call, backend, selection);
  ASTR_CHECK(decision.chosen.has_value(), decision.error);
  report_fallback(decision, call);
  if (!backend && !selection && is_traced(args.q)) record_trace_state(args.q);
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

at::Tensor attention(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale,
    const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& seq_lens,
    const std::optional<at::Tensor>& query_start_loc, int64_t max_query_len,
    std::optional<c10::string_view> mode, std::optional<c10::string_view> backend,
    std::optional<c10::string_view> selection, int64_t window_left, std::optional<double> softcap,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  const AttentionArgs args =
      make_args(q, k, v, attn_mask, is_causal, scale, k_cache, v_cache, block_table, seq_lens,
                query_start_loc, bounded_max_query_len(q, k_cache, max_query_len), mode,
                window_left, softcap, sinks, /*return_lse=*/false, k_scale, v_scale);
  return std::get<0>(run_attention(args, backend, selection));
}

std::tuple<at::Tensor, at::Tensor> attention_with_lse(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale,
    const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& seq_lens,
    const std::optional<at::Tensor>& query_start_loc, int64_t max_query_len,
    std::optional<c10::string_view> mode, std::optional<c10::string_view> backend,
    std::optional<c10::string_view> selection, int64_t window_left, std::optional<double> softcap,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, bool return_lse) {
  ASTR_CHECK_VALUE(return_lse,
                   "return_lse: attention.lse returns (out, lse); call attention without "
                   "return_lse for out alone");
  const AttentionArgs args =
      make_args(q, k, v, attn_mask, is_causal, scale, k_cache, v_cache, block_table, seq_lens,
                query_start_loc, bounded_max_query_len(q, k_cache, max_query_len), mode,
                window_left, softcap, sinks, /*return_lse=*/true, k_scale, v_scale);
  return run_attention(args, backend, selection);
}

std::string explain(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale,
    const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& seq_lens,
    const std::optional<at::Tensor>& query_start_loc, int64_t max_query_len,
    std::optional<c10::string_view> mode, std::optional<c10::string_view> backend,
    int64_t window_left, std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
    bool return_lse, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, std::optional<c10::string_view> selection) {
  const AttentionArgs args = make_args(q, k, v, attn_mask, is_causal, scale, k_cache, v_cache,
                                       block_table, seq_lens, query_start_loc, max_query_len, mode,
                                       window_left, softcap, sinks, return_lse, k_scale, v_scale);
  return decide(validate_and_describe(args), backend, selection).to_json();
}

std::string check_backend(c10::string_view backend, const at::Tensor& q,
                          const std::optional<at::Tensor>& k_cache,
                          const std::optional<at::Tensor>& attn_mask, bool is_causal,
                          std::optional<c10::string_view> mode, bool placement) {
  const std::string name(backend.data(), backend.size());
  const auto parsed = dispatch::parse_backend(name);
  ASTR_CHECK_VALUE(parsed.has_value(), "backend: unknown attention backend '", name,
                   "' (valid: ", dispatch::valid_backend_names(), ")");
  const CallDescription call = describe_form(q, k_cache, attn_mask, is_causal, parse_mode(mode));
  const auto reasons =
      dispatch::rejection_reasons(*parsed, call, BackendStatusTable::instance().get(*parsed),
                                  placement ? dispatch::Checks::kAll : dispatch::Checks::kForm);
  std::string text;
  for (const auto& reason : reasons) text += reason + "\n";
  return text;
}

int64_t push_backend(c10::string_view name) {
  try {
    return static_cast<int64_t>(
        OverrideStack::current().push(std::string(name.data(), name.size())));
  } catch (const std::invalid_argument& error) {
    ASTR_CHECK_VALUE(false, error.what());
  }
}

void pop_backend(std::optional<int64_t> id) {
  if (!id) {
    ASTR_CHECK(OverrideStack::current().depth() > 0,
               "pop_backend: the attention backend override stack is empty");
    OverrideStack::current().pop();
    return;
  }
  ASTR_CHECK(
      *id > 0 && OverrideStack::current().remove(static_cast<uint64_t>(*id)),
      "pop_backend: no override with id ", *id,
      " is on this thread's stack (a context is exited on the thread that entered it, once)");
}

std::string selected_backend() {
  if (auto top = OverrideStack::current().top()) return "context:" + *top;
  const std::string env = environment_backend();
  Selection selection = dispatch::select_backend("", std::nullopt, env, &warn);
  if (selection.source == dispatch::SelectionSource::kEnvironment) {
    return "environment:" + selection.name;
  }
  return "";
}

void check_trace_state(const at::Tensor& q, c10::string_view state) {
  if (is_traced(q) || q.is_meta()) return;  // tracing: the state is the one being recorded
  const std::string now = selected_backend();
  if (now.size() == state.size() && now.compare(0, now.size(), state.data(), state.size()) == 0) {
    return;
  }
  ASTR_CHECK(false, "astr.attention: this compiled graph chose its attention backend under ",
             describe_state(std::string(state.data(), state.size())), ", but now runs under ",
             describe_state(now),
             ". torch.compile does not guard direct torch.ops.astr.attention calls on the "
             "backend context or ASTR_BACKEND: call astrai.extension.attention (it recompiles) "
             "or pass backend=.... Retracing (torch._dynamo.reset()) helps only if the graph was "
             "traced in this process: AOTAutograd's on-disk cache keys graphs on their ops, not "
             "on this choice (torch._functorch.config.enable_autograd_cache = False turns it "
             "off).");
}

void set_backend_status(c10::string_view backend, bool available, c10::string_view reason,
                        int64_t version) {
  const std::string name(backend.data(), backend.size());
  const auto parsed = dispatch::parse_backend(name);
  ASTR_CHECK_VALUE(parsed.has_value(), "backend: unknown attention backend '", name, "'");
  BackendStatusTable::instance().set(
      *parsed, {available, std::string(reason.data(), reason.size()), static_cast<int>(version)});
}

std::string backend_status(c10::string_view backend) {
  const std::string name(backend.data(), backend.size());
  const auto parsed = dispatch::parse_backend(name);
  ASTR_CHECK_VALUE(parsed.has_value(), "backend: unknown attention backend '", name, "'");
  const dispatch::BackendStatus status = BackendStatusTable::instance().get(*parsed);
  std::string reason;
  for (char c : status.reason)
    reason += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return std::string("{\"available\": ") + (status.available ? "true" : "false") +
         ", \"reason\": \"" + reason + "\", \"version\": " + std::to_string(status.version) + "}";
}

}  // namespace astr
