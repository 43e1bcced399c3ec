// astr::append_kv on the CPU: scatter new tokens' k/v into the paged pools.
#include <ATen/ATen.h>

#include "../check.h"
#include "../ops.h"
#include "append_kv_checks.h"

namespace astr {

void append_kv_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  // Everything is checked before either pool is written: a failed call changes nothing.
  check_append_kv_args(k, v, k_cache, v_cache, slot_mapping);
  ASTR_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
             "k_cache, v_cache: expected contiguous pools on the CPU");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const at::Tensor slot = slot_mapping.to(at::kLong);
  const at::Tensor keep = slot.ge(0);
  const at::Tensor kept = slot.masked_select(keep);
  if (kept.numel() > 0) {
    const int64_t largest = kept.max().item<int64_t>();
    ASTR_CHECK(largest < slots, "slot_mapping: slot ", largest, " is out of range for a pool of ",
               slots, " slots (", k_cache.size(0), " pages x ", k_cache.size(1), ")");
  }
  k_cache.view({slots, k_cache.size(2), k_cache.size(3)}).index_copy_(0, kept, k.index({keep}));
  v_cache.view({slots, v_cache.size(2), v_cache.size(3)}).index_copy_(0, kept, v.index({keep}));
}

}  // namespace astr
