// The persistent eight-warp decode kernel (head_dim 128), bf16 and fp16, in a file of its own so
// that the build compiles it in parallel with the others.
#include "paged_decode_persistent_kernel.cuh"

namespace astrai::kernels {
ASTRAI_DEFINE_PAGED_DECODE_PERSISTENT(__nv_bfloat16)
ASTRAI_DEFINE_PAGED_DECODE_PERSISTENT(__half)
}  // namespace astrai::kernels
