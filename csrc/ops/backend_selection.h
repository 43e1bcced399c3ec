// What the user selected for one call, from the op's typed (backend, backend_source) arguments or,
// when the caller observed nothing, from the thread's override stack and ASTR_BACKEND.
#pragma once

#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>

#include "dispatch/resolver.h"

namespace astr {

// backend_source 0 (not observed): `backend` given is a per-call argument; none reads the calling
// thread's override stack, then ASTR_BACKEND. Otherwise a dispatch::SelectionSource number, with
// `backend` the name the caller saw (none for kDefault). Raises naming the argument when they
// do not fit together.
dispatch::Selection call_selection(std::optional<c10::string_view> backend, int64_t backend_source);

}  // namespace astr
