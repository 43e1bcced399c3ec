// The compute capability of a CUDA device as major*10+minor (90 for sm_90); 0 in a build
// without CUDA. Read once per device.
#pragma once

namespace astr {
int cuda_device_arch(int device_index);
}
