#include "override_stack.h"

#include <stdexcept>

#include "call_description.h"

namespace astr::dispatch {

namespace {
constexpr const char kPythonMarker[] = "python:";
}

bool is_python_backend_marker(const std::string& name) {
  return name.rfind(kPythonMarker, 0) == 0 && name.size() > sizeof(kPythonMarker) - 1;
}

OverrideStack& OverrideStack::current() {
  thread_local OverrideStack stack;
  return stack;
}

void OverrideStack::push(const std::string& name) {
  if (!parse_backend(name) && !is_python_backend_marker(name)) {
    throw std::invalid_argument("unknown attention backend '" + name +
                                "' (valid: " + valid_backend_names() + ")");
  }
  names_.push_back(name);
}

void OverrideStack::pop() {
  if (names_.empty()) throw std::logic_error("attention backend override stack is empty");
  names_.pop_back();
}

std::optional<std::string> OverrideStack::top() const {
  if (names_.empty()) return std::nullopt;
  return names_.back();
}

}  // namespace astr::dispatch
