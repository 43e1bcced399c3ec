#include "support/kernel_settings.h"

#include <algorithm>
#include <atomic>
#include <cctype>
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

// An environment variable's value as a switch: 1/true/yes/on or 0/false/no/off in any case (unset
// or empty: off). Anything else raises, naming the variable, at every use until it is fixed: a typo
// must not silently leave the switch off. `what`: what the switch turns on, for the message.
bool switch_from_environment(const char* variable, const char* what) {
  const char* env = std::getenv(variable);
  std::string value = env != nullptr ? env : "";
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* on : {"1", "true", "yes", "on"})
    if (value == on) return true;
  for (const char* off : {"", "0", "false", "no", "off"})
    if (value == off) return false;
  ASTR_CHECK_VALUE(false, variable, ": expected 1, true, yes or on (", what,
                   " on) or 0, false, no or off (", what, " off), in any case; got '", env, "'");
}

std::atomic<bool>& checks_flag() {
  // A throwing initialiser leaves the static uninitialised: the next use reads the variable again.
  static std::atomic<bool> flag{switch_from_environment("ASTR_CHECK_METADATA", "checks")};
  return flag;
}

std::atomic<bool>& batch_invariant_flag() {
  static std::atomic<bool> flag{
      switch_from_environment("ASTR_BATCH_INVARIANT", "batch-invariant results")};
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

bool batch_invariant_enabled() { return batch_invariant_flag().load(std::memory_order_relaxed); }

void set_batch_invariant(bool enabled) { batch_invariant_flag().store(enabled); }

bool batch_invariant() { return batch_invariant_enabled(); }

}  // namespace astr
