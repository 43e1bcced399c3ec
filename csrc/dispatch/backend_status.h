// Whether each backend can run at all in this process (built, package importable, GPU present).
// Per-call rules (dtype, head dim, ...) live in capability.cpp; this is the process-wide part.
#pragma once

#include <mutex>
#include <string>

#include "call_description.h"

namespace astr::dispatch {

struct BackendStatus {
  bool available = false;
  std::string reason;  // why not, when unavailable; a short note (e.g. version) when available
  int version = 0;     // flash: the FlashAttention major version found (2, 3 or 4)
};

// Process-wide table, written at library load (cuda) and by the Python flash probe.
class BackendStatusTable {
 public:
  static BackendStatusTable& instance();
  BackendStatus get(Backend backend) const;
  void set(Backend backend, BackendStatus status);

 private:
  BackendStatusTable();
  mutable std::mutex mutex_;
  BackendStatus status_[kNumBackends];
};

}  // namespace astr::dispatch
