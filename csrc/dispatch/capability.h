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

// The variants of `call` that `backend` does not implement (call_description.h: ASTR_VARIANTS'
// columns), appended to `reasons`: part of rejection_reasons, and the backends' own ops'
// refusal of what they cannot honour (validate_variant_args).
void check_variants(Backend backend, const CallDescription& call,
                    std::vector<std::string>& reasons);

// Every reason `backend` cannot run `call`; empty when it can.
std::vector<std::string> rejection_reasons(Backend backend, const CallDescription& call,
                                           const BackendStatus& status, Checks checks);

}  // namespace astr::dispatch
