#include "override_stack.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "call_description.h"

namespace astr::dispatch {

namespace {
constexpr const char kPythonMarker[] = "python:";

// Process-wide, so that an id handed out on one thread never names an entry of another.
std::atomic<uint64_t> next_entry_id{1};
}  // namespace

bool is_python_backend_marker(const std::string& name) {
  return name.rfind(kPythonMarker, 0) == 0 && name.size() > sizeof(kPythonMarker) - 1;
}

OverrideStack& OverrideStack::current() {
  thread_local OverrideStack stack;
  return stack;
}

uint64_t OverrideStack::push(const std::string& name) {
  const std::optional<Backend> parsed = parse_backend(name);
  if (!parsed && !is_python_backend_marker(name)) {
    throw std::invalid_argument("unknown attention backend '" + name +
                                "' (valid: " + valid_backend_names() + ")");
  }
  const uint64_t id = next_entry_id.fetch_add(1, std::memory_order_relaxed);
  entries_.push_back({id, parsed ? std::string(backend_name(*parsed)) : name});
  return id;
}

void OverrideStack::pop() {
  if (entries_.empty()) throw std::logic_error("attention backend override stack is empty");
  entries_.pop_back();
}

bool OverrideStack::remove(uint64_t id) {
  const auto found = std::find_if(entries_.rbegin(), entries_.rend(),
                                  [id](const Entry& entry) { return entry.id == id; });
  if (found == entries_.rend()) return false;
  entries_.erase(std::next(found).base());
  return true;
}

std::optional<std::string> OverrideStack::top() const {
  if (entries_.empty()) return std::nullopt;
  return entries_.back().name;
}

}  // namespace astr::dispatch
