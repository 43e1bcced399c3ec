// Host entry points of the latent-attention kernels (torch-free; the bindings in
// csrc/backends/cuda/mla_attention.cu and csrc/ops/append_mla_cuda.cu fill the params).
#pragma once

#include <cuda_runtime.h>

#include "../common/launch_status.h"
#include "params.h"
#include "plan.h"

namespace astr::kernels {

// The attention as `plan` says (the simple kernel, or the tensor-core kernel and, with splits,
// its merge into `workspace`, which holds plan.num_splits splits), and for a prefill the kernel
// that poisons the rows its grid cannot place (params.h). No host synchronisation, no
// allocation: capturable in a CUDA graph.
LaunchStatus launch_mla_attention(const MlaAttentionParams& params, const MlaPlan& plan,
                                  const MlaSplitWorkspace& workspace, cudaStream_t stream);

// The tensor-core kernel and its merge (mla_tensor_core_kernel.cu), without the checks and the
// poisoning kernel that launch_mla_attention adds.
LaunchStatus launch_mla_tensor_core(const MlaAttentionParams& params, const MlaPlan& plan,
                                    const MlaSplitWorkspace& workspace, cudaStream_t stream);

// The append (append_mla.cu).
LaunchStatus launch_append_mla(const AppendMlaParams& params, cudaStream_t stream);

}  // namespace astr::kernels
