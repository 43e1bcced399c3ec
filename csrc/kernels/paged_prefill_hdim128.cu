// Paged prefill kernels for head_dim 128, bf16 and fp16 (one file per head dim and kernel so the
// build compiles them in parallel).
#include "paged_attention_kernel.cuh"

namespace astrai::kernels {
ASTRAI_INSTANTIATE_PAGED_ATTENTION(128, false)
}  // namespace astrai::kernels
