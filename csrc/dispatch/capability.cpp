#include "capability.h"

#include <string>

namespace astr::dispatch {

namespace {

bool is_half_precision(ScalarKind dtype) {
  return dtype == ScalarKind::kFloat16 || dtype == ScalarKind::kBFloat16;
}

bool is_power_of_two(int value) { return value > 0 && (value & (value - 1)) == 0; }

std::string arch_string(int arch) { return "sm_" + std::to_string(arch); }

void check_heads_divide(const CallDescription& call, std::vector<std::string>& reasons) {
  if (call.num_kv_heads <= 0 || call.num_q_heads % call.num_kv_heads != 0) {
    reasons.push_back("q heads (" + std::to_string(call.num_q_heads) +
                      ") must be a multiple of kv heads (" + std::to_string(call.num_kv_heads) +
                      ")");
  }
}

void cuda_rules(const CallDescription& call, const BackendStatus& status, Checks checks,
                std::vector<std::string>& reasons) {
  if (checks == Checks::kAll) {
    if (!status.available) reasons.push_back(status.reason);
    if (call.device != DeviceKind::kCUDA) {
      reasons.push_back(std::string("needs CUDA tensors (got ") + device_kind_name(call.device) +
                        ")");
    } else if (call.arch < kCudaMinArch) {
      reasons.push_back("needs sm_80 or newer (got " + arch_string(call.arch) + ")");
    }
  }
  if (!call.has_kv_cache) {
    reasons.push_back("needs a paged KV cache (our kernels serve prefill/decode over the cache)");
  }
  if (!is_half_precision(call.dtype)) {
    reasons.push_back(std::string("dtype ") + scalar_kind_name(call.dtype) +
                      " not supported (supported: float16, bfloat16)");
  }
  bool head_dim_supported = false;
  for (int dim : kCudaHeadDims) head_dim_supported |= (call.head_dim == dim);
  if (!head_dim_supported) {
    reasons.push_back("head_dim " + std::to_string(call.head_dim) +
                      " not supported (supported: 64, 128, 256)");
  }
  if (call.head_dim_v != call.head_dim) {
    reasons.push_back("v head_dim must equal q/k head_dim");
  }
  if (call.has_kv_cache && !is_power_of_two(call.page_size)) {
    reasons.push_back("page_size " + std::to_string(call.page_size) +
                      " not supported (supported: 1, 2, 4, ..., 256)");
  }
  if (call.has_kv_cache && call.page_size > kMaxPageSize) {
    reasons.push_back("page_size " + std::to_string(call.page_size) + " larger than 256");
  }
  if (call.mask == MaskForm::kAdditive) {
    reasons.push_back("additive (float) masks not supported (supported: none, boolean)");
  }
  if (call.needs_grad) reasons.push_back("has no backward (inputs require grad)");
  if (!call.cuda_layout.empty()) reasons.push_back(call.cuda_layout);
  check_heads_divide(call, reasons);
}

void flash_rules(const CallDescription& call, const BackendStatus& status, Checks checks,
                 std::vector<std::string>& reasons) {
  if (checks == Checks::kAll) {
    if (!status.available) reasons.push_back(status.reason);
    if (call.device != DeviceKind::kCUDA) {
      reasons.push_back(std::string("needs CUDA tensors (got ") + device_kind_name(call.device) +
                        ")");
    } else if (status.version == 3 && call.arch != 90) {
      reasons.push_back("FlashAttention-3 needs sm_90 (got " + arch_string(call.arch) + ")");
    } else if (status.version == 4 && call.arch < 90) {
      reasons.push_back("FlashAttention-4 needs sm_90 or newer (got " + arch_string(call.arch) +
                        ")");
    } else if (call.arch < 80) {
      reasons.push_back("FlashAttention-2 needs sm_80 or newer (got " + arch_string(call.arch) +
                        ")");
    }
  }
  if (!is_half_precision(call.dtype)) {
    reasons.push_back(std::string("dtype ") + scalar_kind_name(call.dtype) +
                      " not supported (supported: float16, bfloat16)");
  }
  if (call.head_dim > 256 || call.head_dim % 8 != 0) {
    reasons.push_back("head_dim " + std::to_string(call.head_dim) +
                      " not supported (supported: multiples of 8 up to 256)");
  }
  if (call.head_dim_v != call.head_dim) {
    reasons.push_back("v head_dim must equal q/k head_dim");
  }
  if (call.mask != MaskForm::kNone) {
    reasons.push_back("custom attention mask not supported (only is_causal)");
  }
  if (!call.has_kv_cache && call.is_causal && !call.q_len_equals_kv_len) {
    reasons.push_back(
        "causal with q_len != kv_len: flash aligns the mask bottom-right, astr dense calls "
        "align it top-left like SDPA");
  }
  if (call.has_kv_cache) {
    // FlashAttention-2's paged path reads the pool in 256-token blocks; 3 and 4 take any size.
    const bool fa2_rules = status.version <= 2;
    if (fa2_rules && call.page_size % 256 != 0) {
      reasons.push_back(
          "page_size " + std::to_string(call.page_size) +
          " not supported by FlashAttention-2's paged path (needs a multiple of 256)");
    }
    if (call.needs_grad) reasons.push_back("paged KV-cache path has no backward");
  }
  check_heads_divide(call, reasons);
}

void torch_native_rules(const CallDescription& call, std::vector<std::string>& reasons) {
  if (call.dtype == ScalarKind::kOther) {
    reasons.push_back("dtype not supported (supported: float16, bfloat16, float32, float64)");
  }
  check_heads_divide(call, reasons);
}

}  // namespace

std::vector<std::string> rejection_reasons(Backend backend, const CallDescription& call,
                                           const BackendStatus& status, Checks checks) {
  std::vector<std::string> reasons;
  switch (backend) {
    case Backend::kCuda:
      cuda_rules(call, status, checks, reasons);
      break;
    case Backend::kFlash:
      flash_rules(call, status, checks, reasons);
      break;
    case Backend::kTorchNative:
      torch_native_rules(call, reasons);
      break;
  }
  return reasons;
}

}  // namespace astr::dispatch
