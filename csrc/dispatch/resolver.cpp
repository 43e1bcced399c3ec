#include "resolver.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <mutex>
#include <set>
#include <stdexcept>
#include <unordered_map>

#include "capability.h"
#include "override_stack.h"
#include "preferences.h"

namespace astr::dispatch {

namespace {

std::string source_phrase(SelectionSource source) {
  switch (source) {
    case SelectionSource::kArgument:
      return "from the backend= argument";
    case SelectionSource::kContext:
      return "from an attn_backend(...) context";
    case SelectionSource::kEnvironment:
      return "from ASTR_BACKEND";
    case SelectionSource::kDefault:
      return "by default priority";
  }
  return "";
}

// A call's description and selection packed into a hashable key.
struct DecisionKey {
  uint64_t shape = 0;
  uint64_t flags = 0;
  uint64_t variants = 0;
  uint64_t generation = 0;
  std::string name;
  bool operator==(const DecisionKey& other) const {
    return shape == other.shape && flags == other.flags && variants == other.variants &&
           generation == other.generation && name == other.name;
  }
};

struct DecisionKeyHash {
  size_t operator()(const DecisionKey& key) const {
    uint64_t h = key.shape * 0x9E3779B97F4A7C15ull ^ key.flags * 0xC2B2AE3D27D4EB4Full ^
                 key.variants * 0x165667B19E3779F9ull;
    h ^= key.generation + (h << 6) + (h >> 2);
    return static_cast<size_t>(h ^ std::hash<std::string>()(key.name));
  }
};

// False when a field does not fit its slot in the key (then the decision is not memoised). A call
// with a cuda layout problem (rare: a pool the kernels' copies cannot read) is not memoised
// either, so the key needs no room for the problem's text.
bool pack_key(const CallDescription& c, const Selection& s, uint64_t generation, DecisionKey& key) {
  if (!c.cuda_layout.empty()) return false;
  const int wide[] = {c.head_dim, c.head_dim_v, c.num_q_heads, c.num_kv_heads, c.page_size};
  for (int value : wide) {
    if (value < 0 || value > 0xFFFF) return false;
  }
  if (c.arch < 0 || c.arch > 0xFF || c.q_rank < 0 || c.q_rank > 0xF) return false;
  if (c.query_len_log2 < 0 || c.query_len_log2 > 0x1F) return false;
  if (c.topk_entries < 0 || c.topk_entries > 0x7FFFFFFF) return false;
  key.shape = uint64_t(c.head_dim) | uint64_t(c.head_dim_v) << 16 | uint64_t(c.num_q_heads) << 32 |
              uint64_t(c.num_kv_heads) << 48;
  key.flags = uint64_t(c.page_size) | uint64_t(c.arch) << 16 | uint64_t(c.q_rank) << 24 |
              uint64_t(c.dtype) << 28 | uint64_t(c.device) << 32 | uint64_t(c.mask) << 36 |
              uint64_t(c.mode) << 40 | uint64_t(c.has_kv_cache) << 44 |
              uint64_t(c.needs_grad) << 45 | uint64_t(c.is_causal) << 46 |
              uint64_t(c.q_len_equals_kv_len) << 47 | uint64_t(s.source) << 48 |
              uint64_t(c.kv_dtype) << 52 | uint64_t(c.kv_scales) << 56 |
              uint64_t(c.query_len_log2 & 0x1F) << 57 | uint64_t(c.latent) << 62;
  int bit = 0;
#define ASTR_VARIANT_BIT(field, argument, cuda, flash, torch_native) \
  key.variants |= uint64_t(c.field) << bit++;
  ASTR_VARIANTS(ASTR_VARIANT_BIT)
#undef ASTR_VARIANT_BIT
  key.variants |= uint64_t(c.topk_entries) << 32;
  key.generation = generation;
  key.name = s.name;
  return true;
}

}  // namespace

const Decision& resolve_backend_cached(const CallDescription& call, const Selection& selection,
                                       const BackendStatusTable& table) {
  constexpr size_t kMaxEntries = 512;
  thread_local std::unordered_map<DecisionKey, Decision, DecisionKeyHash> memo;
  thread_local Decision uncached;
  DecisionKey key;
  if (!pack_key(call, selection, table.generation(), key)) {
    uncached = resolve_backend(call, selection, table.snapshot());
    return uncached;
  }
  auto found = memo.find(key);
  if (found != memo.end()) return found->second;
  if (memo.size() >= kMaxEntries) memo.clear();
  Decision decision = resolve_backend(call, selection, table.snapshot());
  return memo.emplace(std::move(key), std::move(decision)).first->second;
}

const char* selection_source_name(SelectionSource source) {
  switch (source) {
    case SelectionSource::kArgument:
      return "argument";
    case SelectionSource::kContext:
      return "context";
    case SelectionSource::kEnvironment:
      return "environment";
    case SelectionSource::kDefault:
      return "default";
  }
  return "default";
}

Selection select_backend(const std::string& argument, const std::optional<std::string>& context_top,
                         const std::string& environment, void (*warn)(const std::string&)) {
  // A backend's other name ("sdpa") stands for its name from here on.
  if (!argument.empty()) {
    const std::optional<Backend> parsed = parse_backend(argument);
    if (!parsed) {
      throw std::invalid_argument("backend: unknown attention backend '" + argument +
                                  "' (valid: " + valid_backend_names() + ")");
    }
    return {SelectionSource::kArgument, backend_name(*parsed)};
  }
  if (context_top) return {SelectionSource::kContext, *context_top};
  if (!environment.empty()) {
    if (const std::optional<Backend> parsed = parse_backend(environment)) {
      return {SelectionSource::kEnvironment, backend_name(*parsed)};
    }
    static std::mutex mutex;
    static std::set<std::string> warned;
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mutex);
      first = warned.count(environment) == 0;
    }
    // Outside the lock: `warn` may wait for Python's GIL, which another thread can hold while it
    // waits for this lock. Marked as given once given: where a warnings filter turns it into an
    // error, `warn` throws and every later call raises again (not silent after the first).
    if (first && warn != nullptr) {
      warn("ASTR_BACKEND='" + environment + "' is not a backend (valid: " + valid_backend_names() +
           "); ignoring it");
      std::lock_guard<std::mutex> lock(mutex);
      warned.insert(environment);
    }
  }
  return {SelectionSource::kDefault, ""};
}

Decision resolve_backend(const CallDescription& call, const Selection& selection,
                         const std::array<BackendStatus, kNumBackends>& status) {
  Decision decision;
  decision.selection = selection;
  for (Backend backend : kAllBackends) {
    int index = static_cast<int>(backend);
    decision.reasons[index] = rejection_reasons(backend, call, status[index], Checks::kAll);
  }
  auto capable = [&](Backend backend) {
    return decision.reasons[static_cast<int>(backend)].empty();
  };

  if (selection.is_strict()) {
    if (is_python_backend_marker(selection.name)) {
      decision.error = "Explicitly-set backend '" + selection.name + "' (" +
                       source_phrase(selection.source) +
                       ") is written in Python: call astrai.extension.attention to run it";
      return decision;
    }
    const std::optional<Backend> parsed = parse_backend(selection.name);
    if (!parsed) {  // a name no stack push or argument lets through; never dereferenced
      decision.error = "Explicitly-set backend '" + selection.name + "' (" +
                       source_phrase(selection.source) +
                       ") is not a backend (valid: " + valid_backend_names() + ")";
      return decision;
    }
    const Backend requested = *parsed;
    if (capable(requested)) {
      decision.chosen = requested;
    } else {
      decision.error = "Explicitly-set backend '" + selection.name + "' (" +
                       source_phrase(selection.source) + ") cannot run this call. " +
                       describe_reasons(decision);
    }
    return decision;
  }

  std::optional<Backend> preferred;
  if (selection.source == SelectionSource::kEnvironment) preferred = parse_backend(selection.name);
  if (preferred && capable(*preferred)) {
    decision.chosen = preferred;
    return decision;
  }
  decision.fell_back = preferred.has_value();
  // The default order, or the faster backend of the call's class where the preference table
  // measured one (explain() names the entry).
  std::array<Backend, kNumBackends> order;
  std::copy(std::begin(kAllBackends), std::end(kAllBackends), order.begin());
  std::optional<Backend> measured;  // passing it by is no fallback: the default order resumes
  if (!preferred) {
    if (const PreferenceEntry* entry =
            measured_preference(call, status[static_cast<int>(Backend::kFlash)])) {
      decision.preference = entry->evidence;
      measured = entry->preferred;
      const auto at = std::find(order.begin(), order.end(), entry->preferred);
      std::rotate(order.begin(), at, at + 1);  // the preferred one first, the rest in order
    }
  }
  for (Backend backend : order) {
    if (capable(backend)) {
      decision.chosen = backend;
      return decision;
    }
    // A backend that is present but refused this call's form means the call runs slower than
    // it could: that is a fallback worth reporting.
    if (status[static_cast<int>(backend)].available && backend != measured) {
      decision.fell_back = true;
    }
  }
  decision.error = "No attention backend can run this call. " + describe_reasons(decision);
  return decision;
}

std::string describe_reasons(const Decision& decision) {
  std::string text = "Backends: ";
  for (Backend backend : kAllBackends) {
    const auto& reasons = decision.reasons[static_cast<int>(backend)];
    if (backend != kAllBackends[0]) text += " | ";
    text += backend_name(backend);
    text += ": ";
    if (reasons.empty()) {
      text += "can run it";
      continue;
    }
    for (size_t i = 0; i < reasons.size(); ++i) {
      if (i) text += "; ";
      text += reasons[i];
    }
  }
  return text;
}

std::string Decision::to_json() const {
  // Built by appending: GCC 12 warns (-Wrestrict, a known false positive) on `"\"" + s` chains.
  auto quoted = [](std::string& out, const std::string& text) {
    out += '"';
    out += json_escape(text);
    out += '"';
  };
  std::string json = "{\"backend\": ";
  if (chosen) {
    quoted(json, backend_name(*chosen));
  } else {
    json += "null";
  }
  json += ", \"source\": ";
  quoted(json, selection_source_name(selection.source));
  json += ", \"requested\": ";
  quoted(json, selection.name);
  json += ", \"fell_back\": ";
  json += fell_back ? "true" : "false";
  json += ", \"error\": ";
  quoted(json, error);
  json += ", \"preference\": ";
  quoted(json, preference);
  json += ", \"reasons\": {";
  for (Backend backend : kAllBackends) {
    if (backend != kAllBackends[0]) json += ", ";
    quoted(json, backend_name(backend));
    json += ": [";
    const auto& list = reasons[static_cast<int>(backend)];
    for (size_t i = 0; i < list.size(); ++i) {
      if (i) json += ", ";
      quoted(json, list[i]);
    }
    json += "]";
  }
  json += "}}";
  return json;
}

}  // namespace astr::dispatch
