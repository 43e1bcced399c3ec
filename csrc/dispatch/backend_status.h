// Whether each backend can run at all in this process (built, package importable, GPU present).
// Per-call rules (dtype, head dim, ...) live in capability.cpp; this is the process-wide part.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "call_description.h"

namespace astr::dispatch {

struct BackendStatus {
  bool available = false;
  std::string reason;  // why not, when unavailable; a short note (e.g. version) when available
  int version = 0;     // flash: the FlashAttention major version found (2, 3 or 4)

  // {"available": ..., "reason": "...", "version": N}
  std::string to_json() const;
};

// `text` as the inside of a JSON string: quotes and backslashes escaped, and every control
// character (below 0x20, and 0x7f) as a u-escape of four hex digits, so that any reason (a tab, an
// ANSI colour from an import error) still makes valid JSON. The one escaper of every JSON this
// library writes.
std::string json_escape(const std::string& text);

// Process-wide table, written at library load (cuda) and by the Python flash probe.
class BackendStatusTable {
 public:
  static BackendStatusTable& instance();
  BackendStatus get(Backend backend) const;
  std::array<BackendStatus, kNumBackends> snapshot() const;
  void set(Backend backend, BackendStatus status);
  // Changes whenever a status does: memoised decisions keyed on it go stale.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

 private:
  BackendStatusTable();
  mutable std::mutex mutex_;
  BackendStatus status_[kNumBackends];
  std::atomic<uint64_t> generation_{0};
};

}  // namespace astr::dispatch
