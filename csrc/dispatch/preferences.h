// The measured preference table: call classes where the flash package ran faster than the cuda
// kernels in a benchmark of record, so that the default order takes the faster one. Explicit
// choices (argument, context) never look here, nor does ASTR_BACKEND's preferred backend.
#pragma once

#include <cstdint>

#include "backend_status.h"
#include "call_description.h"

namespace astr::dispatch {

// One call class: GPU arch, call kind, causal or not, head dim, GQA (q heads > kv heads) or not,
// flash's major version, and max_query_len within [2^min_log2_len, 2^(max_log2_len + 1)).
struct PreferenceEntry {
  int arch;
  Mode mode;
  bool is_causal;
  int head_dim;
  bool gqa;
  int flash_version;
  int min_log2_len;
  int max_log2_len;
  Backend preferred;     // the faster of cuda and flash (cuda where they were level)
  const char* evidence;  // the run and the rows that decided it
};

// The entry of `call`'s class, or null (unmeasured: the default order stands). `flash` is the
// flash backend's status (its version picks the entries; an unavailable flash matches none).
const PreferenceEntry* measured_preference(const CallDescription& call, const BackendStatus& flash);

}  // namespace astr::dispatch
