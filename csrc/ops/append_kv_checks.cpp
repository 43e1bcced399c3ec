#include "ops/append_kv_checks.h"

#include <ATen/MemoryOverlap.h>

#include <string>
#include <unordered_map>
#include <utility>

#include "ops/ops.h"
#include "support/check.h"
#include "support/torch_scalar_type.h"

namespace astr {

void check_append_kv_args(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                          const std::optional<at::Tensor>& k_scale,
                          const std::optional<at::Tensor>& v_scale) {
  const std::pair<const at::Tensor*, const char*> others[] = {
      {&v, "v"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&slot_mapping, "slot_mapping"}};
  for (auto [t, name] : others) {
    ASTR_CHECK(t->device() == k.device(), name, ": expected a tensor on ", k.device(),
               " (the device of k), got ", t->device());
  }
  ASTR_CHECK(k.dim() == 3, "k: expected a 3-D tensor [tokens, kv_heads, head_dim], got shape ",
             sizes_string(k));
  ASTR_CHECK(v.dim() == 3, "v: expected a 3-D tensor [tokens, kv_heads, head_dim], got shape ",
             sizes_string(v));
  ASTR_CHECK(k_cache.dim() == 4,
             "k_cache: expected a 4-D tensor [num_pages, page_size, kv_heads, head_dim], got "
             "shape ",
             sizes_string(k_cache));
  ASTR_CHECK(v_cache.dim() == 4,
             "v_cache: expected a 4-D tensor [num_pages, page_size, kv_heads, head_dim], got "
             "shape ",
             sizes_string(v_cache));
  ASTR_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "v_cache: dtype ",
             v_cache.scalar_type(), " does not match k_cache's ", k_cache.scalar_type());
  if (is_fp8(k_cache.scalar_type())) {
    // Quantized on write: k and v stay in the model's dtype.
    for (auto [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
      const at::ScalarType type = t->scalar_type();
      ASTR_CHECK(type == at::kBFloat16 || type == at::kHalf || type == at::kFloat, name,
                 ": an FP8 pool takes new tokens in bfloat16, float16 or float32 (it quantizes "
                 "them), got ",
                 type);
    }
    ASTR_CHECK(v.scalar_type() == k.scalar_type(), "v: dtype ", v.scalar_type(),
               " does not match k's ", k.scalar_type());
    ASTR_CHECK(k_scale.has_value() && v_scale.has_value(), "k_scale, v_scale: an FP8 pool (",
               k_cache.scalar_type(),
               ") needs its float32 [kv_heads] scales (PagedKVCache.k_scales[layer])");
    for (auto [scale, name] : {std::pair{&*k_scale, "k_scale"}, std::pair{&*v_scale, "v_scale"}}) {
      ASTR_CHECK(scale->scalar_type() == at::kFloat && scale->dim() == 1 &&
                     scale->sym_size(0) == k_cache.sym_size(2),
                 name, ": expected a float32 tensor of shape [kv_heads] = [",
                 size_string(k_cache.sym_size(2)), "], got ", scale->scalar_type(), " of shape ",
                 sizes_string(*scale));
      ASTR_CHECK(scale->device() == k.device(), name, ": expected a tensor on ", k.device(),
                 " (the device of k), got ", scale->device());
    }
  } else {
    ASTR_CHECK(k.scalar_type() == k_cache.scalar_type(), "k: dtype ", k.scalar_type(),
               " does not match k_cache's ", k_cache.scalar_type());
    ASTR_CHECK(v.scalar_type() == v_cache.scalar_type(), "v: dtype ", v.scalar_type(),
               " does not match v_cache's ", v_cache.scalar_type());
    ASTR_CHECK(!k_scale && !v_scale, "k_scale, v_scale: only for FP8 pools (these are ",
               k_cache.scalar_type(), ")");
  }
  ASTR_CHECK(!v_cache.is_same(k_cache),
             "v_cache: the same tensor as k_cache; K and V need pools of their own");
  // The slot mapping addresses both pools: they must agree in pages, page size and heads.
  ASTR_CHECK(v_cache.sym_size(0) == k_cache.sym_size(0) &&
                 v_cache.sym_size(1) == k_cache.sym_size(1) &&
                 v_cache.sym_size(2) == k_cache.sym_size(2),
             "v_cache: shape ", sizes_string(v_cache), " does not match k_cache's ",
             sizes_string(k_cache), " in num_pages, page_size and kv_heads");
  ASTR_CHECK(k.sym_size(1) == k_cache.sym_size(2) && k.sym_size(2) == k_cache.sym_size(3),
             "k: shape ", sizes_string(k), " does not match k_cache's heads/dim [",
             size_string(k_cache.sym_size(2)), ", ", size_string(k_cache.sym_size(3)), "]");
  ASTR_CHECK(v.sym_size(1) == v_cache.sym_size(2) && v.sym_size(2) == v_cache.sym_size(3),
             "v: shape ", sizes_string(v), " does not match v_cache's heads/dim [",
             size_string(v_cache.sym_size(2)), ", ", size_string(v_cache.sym_size(3)), "]");
  ASTR_CHECK(v.sym_size(0) == k.sym_size(0), "v: ", size_string(v.sym_size(0)), " tokens, k has ",
             size_string(k.sym_size(0)));
  check_slot_mapping(slot_mapping, k_cache, "k_cache", k.sym_size(0));
}

void check_slot_mapping(const at::Tensor& slot_mapping, const at::Tensor& cache,
                        const char* cache_name, const c10::SymInt& tokens) {
  // An int32 slot_mapping addresses slots 0 .. 2^31 - 1: a larger pool could not be filled.
  const auto pages = cache.sym_size(0).maybe_as_int();
  const auto page_size = cache.sym_size(1).maybe_as_int();
  if (pages && page_size) {
    ASTR_CHECK(*pages * *page_size <= kMaxPoolSlots, cache_name, ": a pool of ",
               *pages * *page_size, " slots (", *pages, " pages x ", *page_size,
               ") is more than an int32 slot_mapping addresses (at most 2^31 - 1 = ", kMaxPoolSlots,
               " slots)");
  }
  ASTR_CHECK(slot_mapping.scalar_type() == at::kInt, "slot_mapping: expected dtype int32, got ",
             slot_mapping.scalar_type());
  ASTR_CHECK(slot_mapping.dim() == 1 && slot_mapping.sym_size(0) == tokens,
             "slot_mapping: expected [tokens] = [", size_string(tokens), "], got shape ",
             sizes_string(slot_mapping));
}

void check_slots_in_pool(const at::Tensor& kept_slots, const at::Tensor& cache) {
  if (kept_slots.numel() == 0) return;
  const int64_t slots = cache.size(0) * cache.size(1);
  const int64_t largest = kept_slots.max().item<int64_t>();
  ASTR_CHECK(largest < slots, "slot_mapping: slot ", largest, " is out of range for a pool of ",
             slots, " slots (", cache.size(0), " pages x ", cache.size(1), ")");
}

void check_pools_apart(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  // Only the same memory is refused: views whose spans overlap may still never share a slot
  // (transformers' paged cache interleaves K and V pages: K page b + 1 is V page b, and its block
  // ids step by 2).
  ASTR_CHECK(at::get_overlap_status(k_cache, v_cache) != at::MemOverlapStatus::Full,
             "v_cache: the same memory as k_cache (a view of it); K and V need pools of their "
             "own");
}

void check_positive_finite_scale(const at::Tensor& scale, const char* name) {
  const at::Tensor host = scale.detach().cpu();
  const bool good = at::logical_and(host > 0, at::isfinite(host)).all().item<bool>();
  if (good) return;
  std::string values;
  const at::Tensor flat = host.contiguous().view(-1);
  const float* data = flat.data_ptr<float>();
  for (int64_t i = 0; i < flat.numel(); ++i) values += (i ? ", " : "") + std::to_string(data[i]);
  ASTR_CHECK_VALUE(false, name, ": expected positive finite FP8 scales, got [", values, "]");
}

void check_append_kv_values(const at::Tensor& slot_mapping,
                            const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  const at::Tensor slots = slot_mapping.cpu().contiguous();
  const int32_t* slot = slots.data_ptr<int32_t>();
  std::unordered_map<int32_t, int64_t> first_token;
  first_token.reserve(static_cast<size_t>(slots.numel()));
  for (int64_t t = 0; t < slots.numel(); ++t) {
    if (slot[t] < 0) continue;  // skipped tokens may share any negative value
    const auto [entry, inserted] = first_token.emplace(slot[t], t);
    ASTR_CHECK(inserted, "slot_mapping: slot ", slot[t], " appears twice (tokens ", entry->second,
               " and ", t, "); one step writes each slot once");
  }
  if (k_scale) check_positive_finite_scale(*k_scale, "k_scale");
  if (v_scale) check_positive_finite_scale(*v_scale, "v_scale");
}

void append_kv_meta(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const std::optional<at::Tensor>& k_scale,
                    const std::optional<at::Tensor>& v_scale) {
  // Meta tensors hold no data: there is nothing to write, but a call that would fail on a real
  // device fails here too (also a real tensor mixed with meta ones, which dispatches here).
  check_append_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
}

}  // namespace astr
