#include "ops/append_mla_checks.h"

#include <ATen/MemoryOverlap.h>

#include <string>
#include <utility>

#include "ops/append_kv_checks.h"
#include "support/check.h"
#include "support/torch_scalar_type.h"

namespace astr {

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
  check_slot_mapping(slot_mapping, ckv_cache, "ckv_cache", ckv.sym_size(0));
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
