// How this library was built, recorded by setup.py as macros; and the cuda backend's
// process-wide status, which depends only on the build.
#include <string>

#include "dispatch/backend_status.h"
#include "ops.h"

#ifndef ASTR_TORCH_VERSION
#define ASTR_TORCH_VERSION "unknown"
#endif
#ifndef ASTR_CUDA_VERSION
#define ASTR_CUDA_VERSION ""
#endif
#ifndef ASTR_CUDA_ARCHS
#define ASTR_CUDA_ARCHS ""
#endif

namespace astr {

namespace {

bool built_with_cuda() {
#ifdef ASTR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// Runs when the library is loaded.
const bool cuda_status_recorded = [] {
  if (built_with_cuda()) {
    dispatch::BackendStatusTable::instance().set(
        dispatch::Backend::kCuda, {true, std::string("kernels built for ") + ASTR_CUDA_ARCHS, 0});
  }
  return true;
}();

}  // namespace

std::string build_info() {
  return std::string("{\"torch_version\": \"") + ASTR_TORCH_VERSION +
         "\", \"with_cuda\": " + (built_with_cuda() ? "true" : "false") + ", \"cuda_version\": \"" +
         ASTR_CUDA_VERSION + "\", \"cuda_archs\": \"" + ASTR_CUDA_ARCHS + "\"}";
}

}  // namespace astr
