// Host entry points of the latent-attention kernels (torch-free; the bindings in
// csrc/backends/cuda/mla_attention.cu and csrc/ops/append_mla_cuda.cu fill the params).
#pragma once

#include <cuda_runtime.h>

#include "../common/launch_status.h"
#include "params.h"
#include "plan.h"

namespace astr::kernels {

// The attention (mla_attention_kernel.cu) as `plan` says, and for a prefill the kernel that
// poisons the rows its grid cannot place (params.h). No host synchronisation, no allocation:
// capturable in a CUDA graph.
LaunchStatus launch_mla_attention(const MlaAttentionParams& params, const MlaPlan& plan,
                                  cudaStream_t stream);

// The append (append_mla.cu).
LaunchStatus launch_append_mla(const AppendMlaParams& params, cudaStream_t stream);

}  // namespace astr::kernels
