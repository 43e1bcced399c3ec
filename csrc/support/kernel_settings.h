// Process-wide settings of the cuda backend's kernels, readable from any binding (and set through
// the ops set_kernel_tuning / set_metadata_checks): the tuning overrides (parsed once, in
// csrc/kernels/paged_attention/plan.cpp) and the checked mode for paged metadata.
#pragma once

#include "kernels/paged_attention/plan.h"

namespace astr {

// The current tuning: automatic unless ASTR_KERNEL_TUNING (read at library load) or
// set_kernel_tuning says otherwise.
astr::kernels::KernelTuning current_kernel_tuning();

// Checked mode (ASTR_CHECK_METADATA=1, true, yes or on at first use, or set_metadata_checks(true);
// a value that is no such switch raises, naming the variable): every paged call
// reads its metadata back to the host and validates it before running (describe_call.cpp), so bad
// metadata raises an error that names the argument instead of giving NaN rows. A host
// synchronisation per call: for debugging, not for CUDA-graph capture.
bool metadata_checks_enabled();

// Batch-invariant mode (ASTR_BATCH_INVARIANT, read at first use with ASTR_CHECK_METADATA's
// switch values, or set_batch_invariant): every paged call's output rows for a sequence are the
// same bits whatever the batch around it (the cuda plans: plan.h, BatchInvariance; torch_native:
// backends/torch_native.cpp). Read by each call: no host synchronisation.
bool batch_invariant_enabled();

}  // namespace astr
