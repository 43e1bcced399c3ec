// The user's selection, and the ops that read and write its state: the thread-local override
// stack (push_backend / pop_backend), ASTR_BACKEND, each backend's status.
#include "ops/backend_selection.h"

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <tuple>

#include "dispatch/backend_status.h"
#include "dispatch/override_stack.h"
#include "ops/ops.h"
#include "support/check.h"
#include "support/python_warnings.h"

namespace astr {

namespace {

using dispatch::OverrideStack;
using dispatch::Selection;
using dispatch::SelectionSource;

void warn(const std::string& message) { warn_in_python(message); }

std::string environment_backend() {
  const char* value = std::getenv("ASTR_BACKEND");
  return value ? std::string(value) : std::string();
}

std::string to_string(const std::optional<c10::string_view>& text) {
  return text ? std::string(text->data(), text->size()) : std::string();
}

}  // namespace

Selection call_selection(std::optional<c10::string_view> backend, int64_t backend_source) {
  const std::string name = to_string(backend);
  if (backend_source == 0) {
    if (backend) return dispatch::select_backend(name, std::nullopt, "", &warn);
    return dispatch::select_backend("", OverrideStack::current().top(), environment_backend(),
                                    &warn);
  }
  ASTR_CHECK_VALUE(backend_source >= 1 && backend_source <= 4,
                   "backend_source: expected 0 (not observed), 1 (argument), 2 (context), "
                   "3 (environment) or 4 (default), got ",
                   backend_source);
  switch (static_cast<SelectionSource>(backend_source)) {
    case SelectionSource::kArgument:
      ASTR_CHECK_VALUE(backend.has_value(), "backend: backend_source 1 (argument) needs a name");
      return dispatch::select_backend(name, std::nullopt, "", &warn);
    case SelectionSource::kContext: {
      // A context names a backend (the stack validates its pushes; this name is the caller's).
      const auto parsed = dispatch::parse_backend(name);
      ASTR_CHECK_VALUE(parsed.has_value() || dispatch::is_python_backend_marker(name), "backend: '",
                       name, "' (backend_source 2, a context) names no backend ",
                       "(valid: ", dispatch::valid_backend_names(), ", or python:LABEL)");
      return {SelectionSource::kContext, parsed ? dispatch::backend_name(*parsed) : name};
    }
    case SelectionSource::kEnvironment:
      // What ASTR_BACKEND holds: an unknown name is warned about and ignored, as when read here.
      return dispatch::select_backend("", std::nullopt, name, &warn);
    case SelectionSource::kDefault:
      ASTR_CHECK_VALUE(!backend.has_value(), "backend: must be None with backend_source 4 ",
                       "(default), got '", name, "'");
      return {SelectionSource::kDefault, ""};
  }
  ASTR_CHECK(false, "unreachable backend_source");
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

std::tuple<std::string, int64_t> selected_backend() {
  const Selection selection = call_selection(std::nullopt, 0);
  return {selection.name, static_cast<int64_t>(selection.source)};
}

void set_backend_status(c10::string_view backend, bool available, c10::string_view reason,
                        int64_t version) {
  const std::string name(backend.data(), backend.size());
  const auto parsed = dispatch::parse_backend(name);
  ASTR_CHECK_VALUE(parsed.has_value(), "backend: unknown attention backend '", name, "'");
  dispatch::BackendStatusTable::instance().set(
      *parsed, {available, std::string(reason.data(), reason.size()), static_cast<int>(version)});
}

std::string backend_status(c10::string_view backend) {
  const std::string name(backend.data(), backend.size());
  const auto parsed = dispatch::parse_backend(name);
  ASTR_CHECK_VALUE(parsed.has_value(), "backend: unknown attention backend '", name, "'");
  return dispatch::BackendStatusTable::instance().get(*parsed).to_json();
}

}  // namespace astr
