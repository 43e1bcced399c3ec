// Host entry points of the paged attention kernels. Torch-free: the binding
// (csrc/backends/cuda_paged_attention.cu) goes tensors -> params -> plan (plan.h) -> launch, and
// raises on a returned error.
#pragma once

#include <cuda_runtime.h>

#include "../common/launch_status.h"
#include "params.h"
#include "plan.h"

namespace astr::kernels {

// What the plans read of the current device and of this build, kept per device.
DeviceFacts current_device_facts();

// Checks the params against the plan, then launches it on `stream`. No host synchronisation and
// no allocation: a decode can be captured in a CUDA graph and replayed with new seq_lens.
LaunchStatus launch_paged_decode(const PagedDecodeParams& params, const DecodePlan& plan,
                                 cudaStream_t stream);
LaunchStatus launch_paged_prefill(const PagedPrefillParams& params, const PrefillPlan& plan,
                                  cudaStream_t stream);
// A verify: a prefill-mode call run by the decode forms (plan_paged_decode's plan for a shape of
// query_len = max_query_len); CUDA-graph safe as a decode.
LaunchStatus launch_paged_verify(const PagedVerifyParams& params, const DecodePlan& plan,
                                 cudaStream_t stream);

// Sparse top-k attention, decode or prefill (params.query_start_loc null: a decode); CUDA-graph
// safe as a decode.
LaunchStatus launch_paged_topk(const PagedTopkParams& params, const TopkPlan& plan,
                               cudaStream_t stream);

}  // namespace astr::kernels
