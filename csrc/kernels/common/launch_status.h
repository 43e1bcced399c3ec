// The result of a kernel launch, as the torch-free host code returns it to the bindings.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace astr::kernels {

// Empty `error` on success, otherwise a message for the user (an unsupported configuration, or
// the CUDA error reported right after the launch).
struct LaunchStatus {
  std::string error;
  bool ok() const { return error.empty(); }
};

// The error of the launch just made, if any, prefixed with what was launched.
inline LaunchStatus status_after_launch(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return {};
  return {std::string(what) + ": " + cudaGetErrorString(error)};
}

}  // namespace astr::kernels
