#include "support/kernel_settings.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "ops/ops.h"
#include "support/check.h"

namespace astr {

namespace {

struct TuningState {
  std::mutex mutex;
  astr::kernels::KernelTuning tuning;
  std::string text;
};

TuningState& tuning_state() {
  static TuningState* state = [] {
    auto* s = new TuningState;
    if (const char* env = std::getenv("ASTR_KERNEL_TUNING")) {
      const std::string error = astr::kernels::parse_kernel_tuning(env, &s->tuning);
      if (error.empty()) {
        s->text = env;
      } else {
        TORCH_WARN("ASTR_KERNEL_TUNING ignored: ", error);
      }
    }
    return s;
  }();
  return *state;
}

std::atomic<bool>& checks_flag() {
  static std::atomic<bool> flag{[] {
    const char* env = std::getenv("ASTR_CHECK_METADATA");
    return env != nullptr && std::string(env) == "1";
  }()};
  return flag;
}

}  // namespace

astr::kernels::KernelTuning current_kernel_tuning() {
  TuningState& state = tuning_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.tuning;
}

bool metadata_checks_enabled() { return checks_flag().load(std::memory_order_relaxed); }

void set_kernel_tuning(c10::string_view tuning) {
  const std::string text(tuning.data(), tuning.size());
  astr::kernels::KernelTuning parsed;
  const std::string error = astr::kernels::parse_kernel_tuning(text, &parsed);
  ASTR_CHECK_VALUE(error.empty(), "tuning: ", error);
  TuningState& state = tuning_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.tuning = parsed;
  state.text = text;
}

std::string kernel_tuning() {
  TuningState& state = tuning_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.text;
}

void set_metadata_checks(bool enabled) { checks_flag().store(enabled); }

bool metadata_checks() { return metadata_checks_enabled(); }

}  // namespace astr
