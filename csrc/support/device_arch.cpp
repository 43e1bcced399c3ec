#include "support/device_arch.h"

#ifdef ASTR_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace astr {

int cuda_device_arch(int device_index) {
#ifdef ASTR_WITH_CUDA
  if (device_index < 0) return 0;
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(device_index);
  return props->major * 10 + props->minor;
#else
  (void)device_index;
  return 0;
#endif
}

}  // namespace astr
