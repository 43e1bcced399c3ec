// Capability rules: which backend can run which call. They live here and only here; the Python
// classes ask through the `astr::check_backend` op.
#pragma once

#include <string>
#include <vector>

#include "backend_status.h"
#include "call_description.h"

namespace astr::dispatch {

// The cuda kernels' head dims and forms: csrc/kernels/paged_attention/config.h (the one list).
constexpr int kCudaMinArch = 80;
constexpr int kMaxPageSize = 256;

enum class Checks {
  kForm,  // dtype, head dim, cache, page size, mask, mode, gradients: the call's form
  kAll,   // kForm plus placement: built/installed, device and GPU arch
};

// Every reason `backend` cannot run `call`; empty when it can.
std::vector<std::string> rejection_reasons(Backend backend, const CallDescription& call,
                                           const BackendStatus& status, Checks checks);

}  // namespace astr::dispatch
