#include "call_description.h"

namespace astr::dispatch {

const char* backend_name(Backend backend) {
  switch (backend) {
#define ASTR_BACKEND_NAME(enumerator, name, available, reason) \
  case Backend::enumerator:                                    \
    return #name;
    ASTR_BACKENDS(ASTR_BACKEND_NAME)
#undef ASTR_BACKEND_NAME
  }
  return "unknown";
}

std::optional<Backend> parse_backend(std::string_view name) {
  for (Backend backend : kAllBackends) {
    if (name == backend_name(backend)) return backend;
  }
  return std::nullopt;
}

std::string valid_backend_names() {
  std::string names;
  for (Backend backend : kAllBackends) {
    if (!names.empty()) names += ", ";
    names += backend_name(backend);
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
