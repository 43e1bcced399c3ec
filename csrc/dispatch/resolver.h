// Picks the backend for one call: per-call argument > thread-local override stack >
// ASTR_BACKEND > default priority (cuda > flash > torch_native). An explicit choice (argument or
// context) is strict; the environment and the default fall back to the next capable backend.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "backend_status.h"
#include "call_description.h"

namespace astr::dispatch {

// Where a selection came from. The op's `backend_source` argument carries these numbers (0: the
// caller observed nothing, and the op reads the thread's override stack and ASTR_BACKEND).
enum class SelectionSource { kArgument = 1, kContext = 2, kEnvironment = 3, kDefault = 4 };
const char* selection_source_name(SelectionSource source);

// What the user asked for, before looking at the call.
struct Selection {
  SelectionSource source = SelectionSource::kDefault;
  std::string name;  // empty for kDefault; may be a "python:" marker for kContext
  bool is_strict() const {
    return source == SelectionSource::kArgument || source == SelectionSource::kContext;
  }
};

// `argument`: the per-call `backend=` string (empty when not given). `environment`: the value of
// ASTR_BACKEND (empty when unset). An unknown environment value is ignored after one warning
// through `warn`; an unknown argument throws std::invalid_argument.
Selection select_backend(const std::string& argument, const std::optional<std::string>& context_top,
                         const std::string& environment, void (*warn)(const std::string&));

struct Decision {
  Selection selection;
  std::optional<Backend> chosen;  // empty: nothing can run the call (see error)
  bool fell_back = false;         // an implicit choice was skipped for a lower-priority backend
  std::array<std::vector<std::string>, kNumBackends> reasons;  // per backend, empty when capable
  std::string error;  // set when `chosen` is empty: the full message, every backend and why
  // The measured preference that ordered the default choice (preferences.h), "" where none did.
  std::string preference;
  // Set once the caller has reported this (memoised) decision's fallback, so repeated calls
  // with the same decision skip building the report.
  mutable bool fallback_reported = false;

  std::string to_json() const;
};

Decision resolve_backend(const CallDescription& call, const Selection& selection,
                         const std::array<BackendStatus, kNumBackends>& status);

// resolve_backend memoised per thread on (call, selection, status generation): the resolver runs
// on every attention call, and a model repeats a handful of call forms. The reference stays
// valid until this thread's next call of this function.
const Decision& resolve_backend_cached(const CallDescription& call, const Selection& selection,
                                       const BackendStatusTable& table);

// "cuda: reason; reason | flash: ... | torch_native: ok" style summary used in messages.
std::string describe_reasons(const Decision& decision);

}  // namespace astr::dispatch
