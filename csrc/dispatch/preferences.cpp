#include "preferences.h"

#include <iterator>

namespace astr::dispatch {

namespace {

// Written by `make tune` (benchmarks/tune_preferences.py) from benchmark runs of record.
constexpr PreferenceEntry kPreferences[] = {
#include "preference_table.inc"
};

}  // namespace

const PreferenceEntry* measured_preference(const CallDescription& call,
                                           const BackendStatus& flash) {
  // Measured on attention's paged calls; flash has no latent attention to prefer.
  if (!flash.available || !call.has_kv_cache || call.latent) return nullptr;
  const bool gqa = call.num_q_heads > call.num_kv_heads;
  for (const PreferenceEntry& entry : kPreferences) {
    if (entry.arch == call.arch && entry.mode == call.mode && entry.is_causal == call.is_causal &&
        entry.head_dim == call.head_dim && entry.gqa == gqa &&
        entry.flash_version == flash.version && entry.min_log2_len <= call.query_len_log2 &&
        call.query_len_log2 <= entry.max_log2_len) {
      return &entry;
    }
  }
  return nullptr;
}

}  // namespace astr::dispatch
