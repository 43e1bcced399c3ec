#include "backend_status.h"

namespace astr::dispatch {

BackendStatusTable& BackendStatusTable::instance() {
  static BackendStatusTable table;
  return table;
}

BackendStatusTable::BackendStatusTable() {
  status_[static_cast<int>(Backend::kCuda)] = {false, "library built without CUDA kernels", 0};
  status_[static_cast<int>(Backend::kFlash)] = {
      false, "flash-attn not probed yet (astrai.extension probes it on first use)", 0};
  status_[static_cast<int>(Backend::kTorchNative)] = {true, "", 0};
}

BackendStatus BackendStatusTable::get(Backend backend) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return status_[static_cast<int>(backend)];
}

std::array<BackendStatus, kNumBackends> BackendStatusTable::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {status_[0], status_[1], status_[2]};
}

void BackendStatusTable::set(Backend backend, BackendStatus status) {
  std::lock_guard<std::mutex> lock(mutex_);
  status_[static_cast<int>(backend)] = std::move(status);
  generation_.fetch_add(1, std::memory_order_release);
}

}  // namespace astr::dispatch
