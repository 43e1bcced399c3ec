// astr::append_mla on the CPU, its Meta kernel and its Autograd kernel: new tokens' latents and
// rotary keys scattered into the paged latent pools, as astr::append_kv does for K/V
// (append_kv.cpp, append_kv_autograd.cpp say why each kernel is there).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "ops/append_kv_checks.h"
#include "ops/append_mla_checks.h"
#include "ops/ops.h"
#include "support/check.h"
#include "support/torch_scalar_type.h"

namespace astr {

void append_mla_cpu(const at::Tensor& ckv, const at::Tensor& krope, at::Tensor& ckv_cache,
                    at::Tensor& krope_cache, const at::Tensor& slot_mapping,
                    const std::optional<at::Tensor>& ckv_scale) {
  // Everything is checked before either pool is written: a refused call changes nothing.
  check_append_mla_args(ckv, krope, ckv_cache, krope_cache, slot_mapping, ckv_scale);
  ASTR_CHECK(ckv_cache.is_contiguous() && krope_cache.is_contiguous(),
             "ckv_cache, krope_cache: expected contiguous pools on the CPU");
  check_mla_pools_apart(ckv_cache, krope_cache);
  check_append_mla_values(slot_mapping, ckv_scale);  // no synchronisation on the CPU
  const int64_t slots = ckv_cache.size(0) * ckv_cache.size(1);
  const at::Tensor slot = slot_mapping.to(at::kLong);
  const at::Tensor keep = slot.ge(0);
  const at::Tensor kept = slot.masked_select(keep);
  check_slots_in_pool(kept, ckv_cache);
  krope_cache.view({slots, krope_cache.size(2)}).index_copy_(0, kept, krope.index({keep}));
  if (is_fp8(ckv_cache.scalar_type())) {
    // What an FP8 latent stores: fp8(clamp(x / scale, -448, 448)), torch's rounding; written as
    // bytes.
    const at::Tensor scaled = ckv.index({keep}).to(at::kFloat) / *ckv_scale;
    const at::Tensor stored = scaled.clamp(-448.0, 448.0).to(ckv_cache.scalar_type());
    ckv_cache.view(at::kByte)
        .view({slots, ckv_cache.size(2)})
        .index_copy_(0, kept, stored.view(at::kByte));
    return;
  }
  ckv_cache.view({slots, ckv_cache.size(2)}).index_copy_(0, kept, ckv.index({keep}));
}

void append_mla_meta(const at::Tensor& ckv, const at::Tensor& krope, at::Tensor& ckv_cache,
                     at::Tensor& krope_cache, const at::Tensor& slot_mapping,
                     const std::optional<at::Tensor>& ckv_scale) {
  // Nothing to write; a call that would fail on a real device fails here too.
  check_append_mla_args(ckv, krope, ckv_cache, krope_cache, slot_mapping, ckv_scale);
}

void append_mla_autograd(const at::Tensor& ckv, const at::Tensor& krope, at::Tensor& ckv_cache,
                         at::Tensor& krope_cache, const at::Tensor& slot_mapping,
                         const std::optional<at::Tensor>& ckv_scale) {
  // A cache holds values, never an autograd graph (append_kv_autograd.cpp).
  for (auto [pool, name] :
       {std::pair{&ckv_cache, "ckv_cache"}, std::pair{&krope_cache, "krope_cache"}}) {
    ASTR_CHECK(!pool->requires_grad(), name,
               ": a pool that requires grad cannot be written by append_mla (a latent cache holds "
               "values, not an autograd graph); create the pools with requires_grad=False");
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("astr::append_mla", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                      const at::Tensor&, const std::optional<at::Tensor>&)>();
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.call(ckv, krope, ckv_cache, krope_cache, slot_mapping, ckv_scale);
  }
  for (at::Tensor* pool : {&ckv_cache, &krope_cache}) {
    if (!pool->is_inference()) pool->unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace astr
