// Programmatic dependent launch (sm_90): a kernel launched as the dependent of the stream's
// previous kernel may be scheduled while that kernel still runs (once it calls
// allow_dependent_launch, or as its blocks end), and must call wait_for_prerequisite_grid
// (device_primitives.cuh) before it reads anything that kernel writes. Used where a small kernel
// precedes or follows a decode kernel, so that no launch gap separates the two (also inside a
// captured CUDA graph).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace astr::kernels {

// Launches `kernel` on `stream`, as the dependent of the stream's previous kernel when `dependent`
// (callers pass false before sm_90), else as a plain launch. Returns the launch's error.
template <typename... KernelParams, typename... Args>
cudaError_t launch_maybe_dependent(void (*kernel)(KernelParams...), dim3 grid, dim3 block,
                                   size_t dynamic_smem_bytes, cudaStream_t stream, bool dependent,
                                   Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = dynamic_smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  if (dependent) {
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace astr::kernels
