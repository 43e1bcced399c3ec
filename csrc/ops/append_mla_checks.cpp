#include "ops/append_mla_checks.h"

#include <ATen/MemoryOverlap.h>

#include <string>
#include <utility>

#include "ops/append_kv_checks.h"
#include "support/check.h"
#include "support/torch_scalar_type.h"

namespace astr {

namespace {

// "[3, 512]", "?" for a size only known symbolically.
std::string sizes_string(const at::Tensor& t) {
  std::string text = "[";
  const auto sizes = t.sym_sizes();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (d) text += ", ";
    const auto value = sizes[d].maybe_as_int();
    text += value ? std::to_string(*value) : std::string("?");
  }
  return text + "]";
}

std::string size_string(const c10::SymInt& size) {
  const auto value = size.maybe_as_int();
  return value ? std::to_string(*value) : std::string("?");
}

}  // namespace

void check_append_mla_args(const at::Tensor& ckv, const at::Tensor& krope,
                           const at::Tensor& ckv_cache, const at::Tensor& krope_cache,
                           const at::Tensor& slot_mapping,
                           const std::optional<at::Tensor>& ckv_scale) {
  const std::pair<const at::Tensor*, const char*> others[] = {{&krope, "krope"},
                                                              {&ckv_cache, "ckv_cache"},
                                                              {&krope_cache, "krope_cache"},
                                                              {&slot_mapping, "slot_mapping"}};
  for (auto [t, name] : others) {
    ASTR_CHECK(t->device() == ckv.device(), name, ": expected a tensor on ", ckv.device(),
               " (the device of ckv), got ", t->device());
  }
  ASTR_CHECK(ckv.dim() == 2, "ckv: expected a 2-D tensor [tokens, latent_dim], got shape ",
             sizes_string(ckv));
  ASTR_CHECK(krope.dim() == 2, "krope: expected a 2-D tensor [tokens, rope_dim], got shape ",
             sizes_string(krope));
  ASTR_CHECK(ckv_cache.dim() == 3,
             "ckv_cache: expected a 3-D tensor [num_pages, page_size, latent_dim], got shape ",
             sizes_string(ckv_cache));
  ASTR_CHECK(krope_cache.dim() == 3,
             "krope_cache: expected a 3-D tensor [num_pages, page_size, rope_dim], got shape ",
             sizes_string(krope_cache));
  if (is_fp8(ckv_cache.scalar_type())) {
    ASTR_CHECK(ckv_cache.scalar_type() == at::kFloat8_e4m3fn,
               "ckv_cache: an FP8 latent cache holds float8_e4m3fn, got ", ckv_cache.scalar_type());
    const at::ScalarType type = ckv.scalar_type();
    ASTR_CHECK(type == at::kBFloat16 || type == at::kHalf || type == at::kFloat,
               "ckv: an FP8 latent cache takes new latents in bfloat16, float16 or float32 (it "
               "quantizes them), got ",
               type);
    ASTR_CHECK(ckv_scale.has_value(), "ckv_scale: an FP8 latent cache (", ckv_cache.scalar_type(),
               ") needs its float32 [1] scale (PagedLatentCache.ckv_scales[layer])");
    const at::Tensor& scale = *ckv_scale;
    ASTR_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.sym_size(0) == 1,
               "ckv_scale: expected a float32 tensor of shape [1], got ", scale.scalar_type(),
               " of shape ", sizes_string(scale));
    ASTR_CHECK(scale.device() == ckv.device(), "ckv_scale: expected a tensor on ", ckv.device(),
               " (the device of ckv), got ", scale.device());
  } else {
    ASTR_CHECK(ckv.scalar_type() == ckv_cache.scalar_type(), "ckv: dtype ", ckv.scalar_type(),
               " does not match ckv_cache's ", ckv_cache.scalar_type());
    ASTR_CHECK(!ckv_scale, "ckv_scale: only for an FP8 latent cache (ckv_cache holds ",
               ckv_cache.scalar_type(), ")");
  }
  ASTR_CHECK(!is_fp8(krope_cache.scalar_type()),
             "krope_cache: the rotary keys stay in the model's dtype (no FP8 pool), got ",
             krope_cache.scalar_type());
  ASTR_CHECK(krope.scalar_type() == krope_cache.scalar_type(), "krope: dtype ", krope.scalar_type(),
             " does not match krope_cache's ", krope_cache.scalar_type());
  // The slot mapping addresses both pools: they agree in pages and page size.
  ASTR_CHECK(krope_cache.sym_size(0) == ckv_cache.sym_size(0) &&
                 krope_cache.sym_size(1) == ckv_cache.sym_size(1),
             "krope_cache: shape ", sizes_string(krope_cache), " does not match ckv_cache's ",
             sizes_string(ckv_cache), " in num_pages and page_size");
  ASTR_CHECK(ckv.sym_size(1) == ckv_cache.sym_size(2), "ckv: shape ", sizes_string(ckv),
             " does not match ckv_cache's latent dim ", size_string(ckv_cache.sym_size(2)));
  ASTR_CHECK(krope.sym_size(1) == krope_cache.sym_size(2), "krope: shape ", sizes_string(krope),
             " does not match krope_cache's rope dim ", size_string(krope_cache.sym_size(2)));
  ASTR_CHECK(krope.sym_size(0) == ckv.sym_size(0), "krope: ", size_string(krope.sym_size(0)),
             " tokens, ckv has ", size_string(ckv.sym_size(0)));
  const auto pages = ckv_cache.sym_size(0).maybe_as_int();
  const auto page_size = ckv_cache.sym_size(1).maybe_as_int();
  if (pages && page_size) {
    ASTR_CHECK(*pages * *page_size <= kMaxPoolSlots, "ckv_cache: a pool of ", *pages * *page_size,
               " slots (", *pages, " pages x ", *page_size,
               ") is more than an int32 slot_mapping addresses (at most 2^31 - 1 = ", kMaxPoolSlots,
               " slots)");
  }
  ASTR_CHECK(slot_mapping.scalar_type() == at::kInt, "slot_mapping: expected dtype int32, got ",
             slot_mapping.scalar_type());
  ASTR_CHECK(slot_mapping.dim() == 1 && slot_mapping.sym_size(0) == ckv.sym_size(0),
             "slot_mapping: expected [tokens] = [", size_string(ckv.sym_size(0)), "], got shape ",
             sizes_string(slot_mapping));
}

void check_mla_pools_apart(const at::Tensor& ckv_cache, const at::Tensor& krope_cache) {
  // Only the same memory is refused (views of one allocation that never share a slot are fine).
  ASTR_CHECK(at::get_overlap_status(ckv_cache, krope_cache) != at::MemOverlapStatus::Full,
             "krope_cache: the same memory as ckv_cache; the latents and the rotary keys need "
             "pools of their own");
}

void check_append_mla_values(const at::Tensor& slot_mapping,
                             const std::optional<at::Tensor>& ckv_scale) {
  check_append_kv_values(slot_mapping, std::nullopt, std::nullopt);  // no slot written twice
  if (ckv_scale) check_positive_finite_scale(*ckv_scale, "ckv_scale");
}

}  // namespace astr
