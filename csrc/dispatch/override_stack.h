// The thread-local stack of backend overrides pushed by `attn_backend(...)` contexts in Python.
// Each thread sees only its own pushes; nesting is a stack. Every push has an id, and an exit
// removes the entry with its id wherever it is: asyncio tasks sharing a thread enter and exit
// their contexts interleaved, so the entry to remove is not always the top.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace astr::dispatch {

class OverrideStack {
 public:
  // The calling thread's stack.
  static OverrideStack& current();

  // `name` is a built-in backend name or "python:<label>" for a backend written in Python, which
  // only the Python API can run. Anything else throws std::invalid_argument (nothing is pushed).
  // Returns the entry's id, unique in the process, for `remove`.
  uint64_t push(const std::string& name);
  // Removes the top entry. Throws std::logic_error when empty: a pop without a push is a bug in
  // the caller.
  void pop();
  // Removes the entry pushed with `id`, wherever it is in this thread's stack; the entries above
  // it stay, in order. False (nothing changes) when this thread's stack holds no such entry.
  bool remove(uint64_t id);
  std::optional<std::string> top() const;
  size_t depth() const { return entries_.size(); }
  // Used when a thread's contexts must be unwound all at once (tests).
  void clear() { entries_.clear(); }

 private:
  struct Entry {
    uint64_t id;
    std::string name;
  };
  std::vector<Entry> entries_;
};

bool is_python_backend_marker(const std::string& name);

}  // namespace astr::dispatch
