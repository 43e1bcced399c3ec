// The thread-local stack of backend overrides pushed by `attn_backend(...)` contexts in Python.
// Each thread sees only its own pushes; nesting is a stack.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace astr::dispatch {

class OverrideStack {
 public:
  // The calling thread's stack.
  static OverrideStack& current();

  // `name` is a built-in backend name or "python:<label>" for a backend written in Python, which
  // only the Python API can run. Anything else throws std::invalid_argument.
  void push(const std::string& name);
  // Throws std::logic_error when empty: a pop without a push is a bug in the caller.
  void pop();
  std::optional<std::string> top() const;
  size_t depth() const { return names_.size(); }
  // Used when a thread's contexts must be unwound all at once (tests).
  void clear() { names_.clear(); }

 private:
  std::vector<std::string> names_;
};

bool is_python_backend_marker(const std::string& name);

}  // namespace astr::dispatch
