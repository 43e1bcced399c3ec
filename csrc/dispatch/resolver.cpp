#include "resolver.h"

#include <mutex>
#include <set>
#include <stdexcept>

#include "capability.h"
#include "override_stack.h"

namespace astr::dispatch {

namespace {

std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out;
}

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

}  // namespace

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
  if (!argument.empty()) {
    if (!parse_backend(argument)) {
      throw std::invalid_argument("backend: unknown attention backend '" + argument +
                                  "' (valid: " + valid_backend_names() + ")");
    }
    return {SelectionSource::kArgument, argument};
  }
  if (context_top) return {SelectionSource::kContext, *context_top};
  if (!environment.empty()) {
    if (parse_backend(environment)) return {SelectionSource::kEnvironment, environment};
    static std::mutex mutex;
    static std::set<std::string> warned;
    std::lock_guard<std::mutex> lock(mutex);
    if (warned.insert(environment).second && warn != nullptr) {
      warn("ASTR_BACKEND='" + environment + "' is not a backend (valid: " +
           valid_backend_names() + "); ignoring it");
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
    Backend requested = *parse_backend(selection.name);
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
  for (Backend backend : kAllBackends) {
    if (capable(backend)) {
      decision.chosen = backend;
      return decision;
    }
    // A backend that is present but refused this call's form means the call runs slower than
    // it could: that is a fallback worth reporting.
    if (status[static_cast<int>(backend)].available) decision.fell_back = true;
  }
  decision.error = "No attention backend can run this call. " + describe_reasons(decision);
  return decision;
}

std::string describe_reasons(const Decision& decision) {
  std::string text = "Backends: ";
  for (Backend backend : kAllBackends) {
    const auto& reasons = decision.reasons[static_cast<int>(backend)];
    if (backend != Backend::kCuda) text += " | ";
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
  json += ", \"reasons\": {";
  for (Backend backend : kAllBackends) {
    if (backend != Backend::kCuda) json += ", ";
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
