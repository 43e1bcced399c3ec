#include "backend_status.h"

namespace astr::dispatch {

BackendStatusTable& BackendStatusTable::instance() {
  static BackendStatusTable table;
  return table;
}

BackendStatusTable::BackendStatusTable() {
#define ASTR_BACKEND_STATUS(enumerator, name, available, reason) \
  status_[static_cast<int>(Backend::enumerator)] = {available, reason, 0};
  ASTR_BACKENDS(ASTR_BACKEND_STATUS)
#undef ASTR_BACKEND_STATUS
}

BackendStatus BackendStatusTable::get(Backend backend) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return status_[static_cast<int>(backend)];
}

std::array<BackendStatus, kNumBackends> BackendStatusTable::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::array<BackendStatus, kNumBackends> copy;
  for (int i = 0; i < kNumBackends; ++i) copy[i] = status_[i];
  return copy;
}

void BackendStatusTable::set(Backend backend, BackendStatus status) {
  std::lock_guard<std::mutex> lock(mutex_);
  status_[static_cast<int>(backend)] = std::move(status);
  generation_.fetch_add(1, std::memory_order_release);
}

}  // namespace astr::dispatch
