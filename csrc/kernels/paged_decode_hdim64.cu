// Paged decode kernels for head_dim 64, bf16 and fp16 (one file per head dim and kernel so the
// build compiles them in parallel).
#include "paged_attention_kernel.cuh"

namespace astrai::kernels {
ASTRAI_INSTANTIATE_PAGED_ATTENTION(64, true)
}  // namespace astrai::kernels
