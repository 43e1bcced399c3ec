// astr::append_kv on the CPU: scatter new tokens' k/v into the paged pools.
#include <ATen/ATen.h>

#include "../check.h"
#include "../ops.h"

namespace astr {

void append_kv_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  ASTR_CHECK(k.dim() == 3, "k: expected [tokens, kv_heads, head_dim], got ", k.dim(), "-D");
  ASTR_CHECK(v.dim() == 3, "v: expected [tokens, kv_heads, head_dim], got ", v.dim(), "-D");
  ASTR_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
             "k_cache, v_cache: expected [num_pages, page_size, kv_heads, head_dim]");
  ASTR_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
             "k_cache, v_cache: expected contiguous pools");
  ASTR_CHECK(k.scalar_type() == k_cache.scalar_type(), "k: dtype ", k.scalar_type(),
             " does not match k_cache's ", k_cache.scalar_type());
  ASTR_CHECK(v.scalar_type() == v_cache.scalar_type(), "v: dtype ", v.scalar_type(),
             " does not match v_cache's ", v_cache.scalar_type());
  ASTR_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k: shape [", k.size(0),
             ", ", k.size(1), ", ", k.size(2), "] does not match k_cache's heads/dim [",
             k_cache.size(2), ", ", k_cache.size(3), "]");
  ASTR_CHECK(v.size(1) == v_cache.size(2) && v.size(2) == v_cache.size(3),
             "v: heads/head_dim do not match v_cache's");
  ASTR_CHECK(v.size(0) == k.size(0), "v: ", v.size(0), " tokens, k has ", k.size(0));
  ASTR_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0),
             "slot_mapping: expected [tokens] = [", k.size(0), "]");
  ASTR_CHECK(slot_mapping.scalar_type() == at::kInt, "slot_mapping: expected dtype int32, got ",
             slot_mapping.scalar_type());
  const std::pair<const at::Tensor*, const char*> named[] = {{&k, "k"},
                                                             {&v, "v"},
                                                             {&k_cache, "k_cache"},
                                                             {&v_cache, "v_cache"},
                                                             {&slot_mapping, "slot_mapping"}};
  for (auto [t, name] : named) {
    ASTR_CHECK(t->device().is_cpu(), name, ": expected a CPU tensor, got ", t->device());
  }
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
