// astr::append_kv on the CPU: scatter new tokens' k/v into the paged pools.
#include <ATen/ATen.h>

#include "ops/append_kv_checks.h"
#include "ops/ops.h"
#include "support/check.h"
#include "support/torch_scalar_type.h"

namespace astr {

namespace {

// What an FP8 pool stores of x: fp8(clamp(x / scale[kv head], -max, max)), torch's rounding.
at::Tensor quantized(const at::Tensor& x, const at::Tensor& scale, at::ScalarType pool_type) {
  const double max = pool_type == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
  const at::Tensor scaled = x.to(at::kFloat) / scale.view({1, -1, 1});
  return scaled.clamp(-max, max).to(pool_type);
}

}  // namespace

void append_kv_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping,
                   const std::optional<at::Tensor>& k_scale,
                   const std::optional<at::Tensor>& v_scale) {
  // Everything is checked before either pool is written: a failed call changes nothing.
  check_append_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  ASTR_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
             "k_cache, v_cache: expected contiguous pools on the CPU");
  check_pools_apart(k_cache, v_cache);
  check_append_kv_values(slot_mapping, k_scale, v_scale);  // no synchronisation on the CPU
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const at::Tensor slot = slot_mapping.to(at::kLong);
  const at::Tensor keep = slot.ge(0);
  const at::Tensor kept = slot.masked_select(keep);
  check_slots_in_pool(kept, k_cache);
  if (is_fp8(k_cache.scalar_type())) {
    // Written as bytes: the FP8 values quantized from the kept tokens.
    const at::Tensor k_bytes = quantized(k.index({keep}), *k_scale, k_cache.scalar_type());
    const at::Tensor v_bytes = quantized(v.index({keep}), *v_scale, v_cache.scalar_type());
    k_cache.view(at::kByte)
        .view({slots, k_cache.size(2), k_cache.size(3)})
        .index_copy_(0, kept, k_bytes.view(at::kByte));
    v_cache.view(at::kByte)
        .view({slots, v_cache.size(2), v_cache.size(3)})
        .index_copy_(0, kept, v_bytes.view(at::kByte));
    return;
  }
  k_cache.view({slots, k_cache.size(2), k_cache.size(3)}).index_copy_(0, kept, k.index({keep}));
  v_cache.view({slots, v_cache.size(2), v_cache.size(3)}).index_copy_(0, kept, v.index({keep}));
}

}  // namespace astr
