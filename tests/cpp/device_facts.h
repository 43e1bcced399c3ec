// The GPUs the plan tests plan for: an H100/H200 (sm_90, a library built for sm_90a) and an A100
// (sm_80), as current_device_facts() reads them (L2 size unknown unless a test sets it).
#pragma once

#include "../../csrc/kernels/paged_attention/plan.h"

namespace astr::kernels::testing {

inline DeviceFacts sm90_facts() {
  DeviceFacts facts;
  facts.arch = 90;
  facts.num_sms = 132;
  facts.max_smem_per_block = 227 * 1024;
  facts.max_smem_per_sm = 228 * 1024;
  facts.has_sm90a_code = true;
  return facts;
}

inline DeviceFacts sm80_facts() {
  DeviceFacts facts;
  facts.arch = 80;
  facts.num_sms = 108;
  facts.max_smem_per_block = 163 * 1024;
  facts.max_smem_per_sm = 164 * 1024;
  return facts;
}

}  // namespace astr::kernels::testing
