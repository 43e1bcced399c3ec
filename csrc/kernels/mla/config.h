// What the cuda latent-attention kernels take: the one list that the capability rules
// (csrc/dispatch/capability.cpp), the binding's checks and the kernels read. Torch-free.
#pragma once

namespace astr::kernels {

constexpr int kMlaLatentDim = 512;  // Dc: the latent (key and value) of every DeepSeek-family model
constexpr int kMlaRopeDim = 64;     // Dr: the rotary key shared by every head
constexpr int kMlaMaxPageSize = 256;  // any page size 1 .. 256 (the kernel divides positions)
constexpr int kMlaMinArch = 80;       // mla_attention_kernel.cu needs nothing newer than sm_80

}  // namespace astr::kernels
