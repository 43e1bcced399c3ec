#include "capability.h"

#include <array>
#include <string>

#include "../kernels/mla/config.h"
#include "../kernels/paged_attention/config.h"
#include "../kernels/paged_attention/plan.h"

namespace astr::dispatch {

namespace {

bool is_power_of_two(int value) { return value > 0 && (value & (value - 1)) == 0; }

std::string arch_string(int arch) { return "sm_" + std::to_string(arch); }

void check_heads_divide(const CallDescription& call, std::vector<std::string>& reasons) {
  if (call.num_kv_heads <= 0 || call.num_q_heads % call.num_kv_heads != 0) {
    reasons.push_back("q heads (" + std::to_string(call.num_q_heads) +
                      ") must be a multiple of kv heads (" + std::to_string(call.num_kv_heads) +
                      ")");
  }
}

// The cache's element type: q's own (every backend), or FP8 with per-head scales where
// `fp8_cache` says the backend reads it (and then only with its scales, which only it takes).
void check_kv_dtype(const CallDescription& call, bool fp8_cache,
                    std::vector<std::string>& reasons) {
  const bool fp8 = is_fp8(call.kv_dtype);
  if (call.kv_dtype != call.dtype && call.kv_dtype != ScalarType::kOther && !(fp8 && fp8_cache)) {
    reasons.push_back(std::string("KV cache dtype ") + scalar_type_name(call.kv_dtype) +
                      " not supported (supported: q's dtype, " + scalar_type_name(call.dtype) +
                      (fp8_cache ? ", or float8_e4m3fn / float8_e5m2 with 16-bit q" : "") + ")");
  }
  if (call.kv_scales && !fp8) reasons.push_back("k_scale/v_scale: only for an FP8 KV cache");
}

// The cuda backend's latent attention (astr::mla_attention): csrc/kernels/mla/config.h.
void cuda_latent_rules(const CallDescription& call, const BackendStatus& status, Checks checks,
                       std::vector<std::string>& reasons) {
  using namespace astr::kernels;
  if (checks == Checks::kAll) {
    if (!status.available) reasons.push_back(status.reason);
    if (call.device != DeviceKind::kCUDA) {
      reasons.push_back(std::string("needs CUDA tensors (got ") + device_kind_name(call.device) +
                        ")");
    } else if (call.arch < kMlaMinArch) {
      reasons.push_back("needs sm_80 or newer (got " + arch_string(call.arch) + ")");
    }
  }
  if (!is_half_precision(call.dtype)) {
    reasons.push_back(std::string("dtype ") + scalar_type_name(call.dtype) +
                      " not supported (supported: float16, bfloat16)");
  }
  const int rope_dim = call.head_dim - call.head_dim_v;
  if (call.head_dim_v != kMlaLatentDim || rope_dim != kMlaRopeDim) {
    reasons.push_back("latent dim " + std::to_string(call.head_dim_v) + " and rope dim " +
                      std::to_string(rope_dim) + " not supported (supported: " +
                      std::to_string(kMlaLatentDim) + " and " + std::to_string(kMlaRopeDim) + ")");
  }
  if (call.page_size < 1 || call.page_size > kMlaMaxPageSize) {
    reasons.push_back("page_size " + std::to_string(call.page_size) +
                      " not supported (supported: 1 to 256)");
  }
  if (call.needs_grad) reasons.push_back("has no backward (inputs require grad)");
  if (!call.cuda_layout.empty()) reasons.push_back(call.cuda_layout);
  check_kv_dtype(call, /*fp8_cache=*/true, reasons);
}

void cuda_rules(const CallDescription& call, const BackendStatus& status, Checks checks,
                std::vector<std::string>& reasons) {
  if (call.latent) {
    cuda_latent_rules(call, status, checks, reasons);
    return;
  }
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
    reasons.push_back(std::string("dtype ") + scalar_type_name(call.dtype) +
                      " not supported (supported: float16, bfloat16)");
  }
  // The (q/k, v) head-dim pairs the kernels were built for: config.h's list.
  const astr::kernels::HeadDimForms* forms =
      astr::kernels::paged_head_dim_forms(call.head_dim, call.head_dim_v);
  if (forms == nullptr) {
    reasons.push_back(astr::kernels::unsupported_head_dim_message(call.head_dim, call.head_dim_v));
  } else if (call.device == DeviceKind::kCUDA && call.arch >= kCudaMinArch &&
             call.arch < astr::kernels::paged_head_dim_min_arch(*forms)) {
    reasons.push_back("head_dim " + std::to_string(call.head_dim) + " needs " +
                      arch_string(astr::kernels::paged_head_dim_min_arch(*forms)) +
                      " or newer (its decode block's shared memory; got " + arch_string(call.arch) +
                      ")");
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
  if (call.topk && forms != nullptr && !forms->topk) {
    reasons.push_back(astr::kernels::topk_head_dim_message(*forms));
  }
  // The top-k kernels' listing pass holds a row's entries in a table in shared memory (plan.h).
  if (call.topk && call.topk_entries > astr::kernels::kTopkMaxEntries) {
    reasons.push_back("topk_indices: " + std::to_string(call.topk_entries) +
                      " entries per query row (the kernels take at most " +
                      std::to_string(astr::kernels::kTopkMaxEntries) + ")");
  }
  check_kv_dtype(call, /*fp8_cache=*/true, reasons);
  check_heads_divide(call, reasons);
}

// A v head dim other than q/k's (DeepSeek's MHA form: 192 and 128), as each FlashAttention takes
// it: 2 never; 3 (sm_90) for q/k in (128, 192] with v in (96, 128], or q/k <= 64 with v <= 512;
// 4 for (192, 128) everywhere and, on sm_90, any pair of multiples of 8 up to 256. Gradients
// only with equal dims (the packages' backward for unequal ones is not relied on).
void check_flash_head_dim_v(const CallDescription& call, const BackendStatus& status,
                            std::vector<std::string>& reasons) {
  const int qk = call.head_dim, v = call.head_dim_v;
  if (v == qk) return;
  const std::string dims =
      "v head_dim " + std::to_string(v) + " with q/k head_dim " + std::to_string(qk);
  bool taken = false;
  std::string supported;
  if (status.version == 3) {
    taken = (qk > 128 && qk <= 192 && v > 96 && v <= 128) || (qk <= 64 && v <= 512);
    supported =
        "FlashAttention-3 takes q/k in (128, 192] with v in (96, 128], or q/k <= 64 "
        "with v <= 512";
  } else if (status.version == 4) {
    taken = (qk == 192 && v == 128) || (call.arch == 90 && v <= 256);
    supported = "FlashAttention-4 takes (192, 128), and on sm_90 any multiples of 8 up to 256";
  } else {
    supported = "FlashAttention-2 takes equal q/k and v head dims only";
  }
  if (taken && v % 8 != 0) {
    taken = false;
    supported = "v head_dim must be a multiple of 8";
  }
  if (!taken) reasons.push_back(dims + " not supported (" + supported + ")");
  if (taken && call.needs_grad) {
    reasons.push_back("gradients with " + dims + " not supported by the flash backend");
  }
}

void flash_rules(const CallDescription& call, const BackendStatus& status, Checks checks,
                 std::vector<std::string>& reasons) {
  if (call.latent) {  // flash-attn's packages have no latent attention
    reasons.push_back("latent attention (mla_attention) not supported by the flash backend");
    return;
  }
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
    reasons.push_back(std::string("dtype ") + scalar_type_name(call.dtype) +
                      " not supported (supported: float16, bfloat16)");
  }
  if (call.head_dim > 256 || call.head_dim % 8 != 0) {
    reasons.push_back("head_dim " + std::to_string(call.head_dim) +
                      " not supported (supported: multiples of 8 up to 256)");
  }
  check_flash_head_dim_v(call, status, reasons);
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
  if (call.needs_grad && (call.window || call.softcap)) {
    reasons.push_back("gradients with window_left or softcap not supported by the flash backend");
  }
  // FlashAttention-3 reads FP8 only with an FP8 q (and 4 has no FP8 cache path): astrai keeps q
  // in the model's dtype.
  if (is_fp8(call.kv_dtype)) {
    reasons.push_back("FP8 KV cache with a 16-bit q not supported by flash-attn");
  } else {
    check_kv_dtype(call, /*fp8_cache=*/false, reasons);
  }
  check_heads_divide(call, reasons);
}

void torch_native_rules(const CallDescription& call, const BackendStatus&, Checks,
                        std::vector<std::string>& reasons) {
  if (call.dtype == ScalarType::kOther || call.dtype == ScalarType::kFloat8E4M3 ||
      call.dtype == ScalarType::kFloat8E5M2) {
    reasons.push_back("dtype not supported (supported: float16, bfloat16, float32, float64)");
  }
  check_kv_dtype(call, /*fp8_cache=*/true, reasons);
  check_heads_divide(call, reasons);
}

using Rules = void (*)(const CallDescription&, const BackendStatus&, Checks,
                       std::vector<std::string>&);

// One rules function per backend, in the list's order (call_description.h: ASTR_BACKENDS).
constexpr Rules kRules[] = {
#define ASTR_BACKEND_RULES(enumerator, name, available, reason, aliases) &name##_rules,
    ASTR_BACKENDS(ASTR_BACKEND_RULES)
#undef ASTR_BACKEND_RULES
};

}  // namespace

void check_variants(Backend backend, const CallDescription& call,
                    std::vector<std::string>& reasons) {
  static_assert(kNumBackends == 3, "ASTR_VARIANTS has one column per backend");
#define ASTR_VARIANT_RULE(field, argument, cuda, flash, torch_native)                            \
  if (call.field &&                                                                              \
      !std::array<bool, kNumBackends>{cuda, flash, torch_native}[static_cast<int>(backend)]) {   \
    reasons.push_back(std::string(argument) + " not supported by the " + backend_name(backend) + \
                      " backend");                                                               \
  }
  ASTR_VARIANTS(ASTR_VARIANT_RULE)
#undef ASTR_VARIANT_RULE
}

std::vector<std::string> rejection_reasons(Backend backend, const CallDescription& call,
                                           const BackendStatus& status, Checks checks) {
  std::vector<std::string> reasons;
  kRules[static_cast<int>(backend)](call, status, checks, reasons);
  check_variants(backend, call, reasons);
  return reasons;
}

}  // namespace astr::dispatch
