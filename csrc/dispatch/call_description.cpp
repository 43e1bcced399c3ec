#include "call_description.h"

namespace astr::dispatch {

const char* backend_name(Backend backend) {
  switch (backend) {
#define ASTR_BACKEND_NAME(enumerator, name, available, reason, aliases) \
  case Backend::enumerator:                                             \
    return #name;
    ASTR_BACKENDS(ASTR_BACKEND_NAME)
#undef ASTR_BACKEND_NAME
  }
  return "unknown";
}

const char* backend_aliases(Backend backend) {
  switch (backend) {
#define ASTR_BACKEND_ALIASES(enumerator, name, available, reason, aliases) \
  case Backend::enumerator:                                                \
    return aliases;
    ASTR_BACKENDS(ASTR_BACKEND_ALIASES)
#undef ASTR_BACKEND_ALIASES
  }
  return "";
}

namespace {

// Whether `name` is one of the comma-separated names of `aliases`.
bool is_alias(std::string_view name, std::string_view aliases) {
  while (!aliases.empty()) {
    const size_t comma = aliases.find(',');
    if (aliases.substr(0, comma) == name) return true;
    if (comma == std::string_view::npos) break;
    aliases.remove_prefix(comma + 1);
  }
  return false;
}

}  // namespace

std::optional<Backend> parse_backend(std::string_view name) {
  for (Backend backend : kAllBackends) {
    if (name == backend_name(backend)) return backend;
  }
  for (Backend backend : kAllBackends) {
    if (!name.empty() && is_alias(name, backend_aliases(backend))) return backend;
  }
  return std::nullopt;
}

std::string valid_backend_names() {
  std::string names;
  for (Backend backend : kAllBackends) {
    if (!names.empty()) names += ", ";
    names += backend_name(backend);
    if (*backend_aliases(backend)) names += std::string(" (or ") + backend_aliases(backend) + ")";
  }
  return names;
}

const char* device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCPU:
      return "cpu";
    case DeviceKind::kCUDA:
      return "cuda";
    case DeviceKind::kOther:
      return "other";
  }
  return "other";
}

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kTraining:
      return "training";
    case Mode::kPrefill:
      return "prefill";
    case Mode::kDecode:
      return "decode";
  }
  return "unknown";
}

}  // namespace astr::dispatch
