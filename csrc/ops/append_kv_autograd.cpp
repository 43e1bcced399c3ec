// astr::append_kv under autograd (the Autograd alias key: CPU, CUDA and every other device). A KV
// cache holds values, never an autograd graph: the write runs below autograd, so k and v that
// require grad (a model's projections outside torch.no_grad(), as in an inference loop) are
// stored as their values, and the pools never link one step to the graph of the step before (that
// link kept every step's graph alive: memory grew without bound). Gradients do not flow into a
// cache through append_kv; the attention that reads the cache stays differentiable in q.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "ops/ops.h"
#include "support/check.h"

namespace astr {

void append_kv_autograd(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  // A pool that requires grad would be written without the in-place record autograd keeps for
  // it (its gradient would silently be wrong): refused, like an in-place write into a leaf.
  for (auto [pool, name] : {std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"}}) {
    ASTR_CHECK(!pool->requires_grad(), name,
               ": a pool that requires grad cannot be written by append_kv (a KV cache holds "
               "values, not an autograd graph); create the pools with requires_grad=False");
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("astr::append_kv", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                      const at::Tensor&, const std::optional<at::Tensor>&,
                      const std::optional<at::Tensor>&)>();
  {
    // Below autograd for the device kernel and every ATen call it makes (the CPU kernel's
    // index_copy_ would otherwise record history into the pools).
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.call(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  }
  // What the skipped ADInplaceOrView kernel does for a mutated tensor: a graph that saved a pool
  // before this write now sees it was modified. Inference tensors carry no version counter.
  for (at::Tensor* pool : {&k_cache, &v_cache}) {
    if (!pool->is_inference()) pool->unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace astr
