// Paged prefill on wgmma (sm_90a) for head_dim 64, bf16 and fp16. Built for every arch; only the
// sm_90a image does the work (elsewhere the kernel traps and the host never launches it).
#include "paged_prefill_wgmma_kernel.cuh"

namespace astrai::kernels {
ASTRAI_INSTANTIATE_PAGED_PREFILL_WGMMA(64)
}  // namespace astrai::kernels
