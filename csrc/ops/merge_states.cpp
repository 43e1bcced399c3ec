// astr::merge_states: two partial attentions over disjoint key sets, combined exactly through
// their log-sum-exps (composite ATen: every device, differentiable, no host synchronisation).
#include <ATen/ATen.h>

#include <limits>
#include <tuple>

#include "ops/ops.h"
#include "support/check.h"

namespace astr {

std::tuple<at::Tensor, at::Tensor> merge_states(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                const at::Tensor& out_b, const at::Tensor& lse_b) {
  ASTR_CHECK_VALUE(out_a.dim() >= 1 && out_a.sizes() == out_b.sizes(),
                   "out_b: expected the shape of out_a ", out_a.sizes(), ", got ", out_b.sizes());
  ASTR_CHECK_VALUE(out_a.scalar_type() == out_b.scalar_type(), "out_b: expected dtype ",
                   out_a.scalar_type(), " (out_a's), got ", out_b.scalar_type());
  const auto rows = out_a.sizes().slice(0, out_a.dim() - 1);
  for (auto [lse, name] : {std::pair{&lse_a, "lse_a"}, std::pair{&lse_b, "lse_b"}}) {
    ASTR_CHECK_VALUE(lse->scalar_type() == at::kFloat, name, ": expected float32, got ",
                     lse->scalar_type());
    ASTR_CHECK_VALUE(lse->sizes() == rows, name, ": expected shape ", rows,
                     " (out's without its last dim), got ", lse->sizes());
  }
  for (auto [t, name] :
       {std::pair{&lse_a, "lse_a"}, std::pair{&out_b, "out_b"}, std::pair{&lse_b, "lse_b"}}) {
    ASTR_CHECK_VALUE(t->device() == out_a.device(), name, ": expected a tensor on ", out_a.device(),
                     " (out_a's device), got ", t->device());
  }
  const double inf = std::numeric_limits<double>::infinity();
  // Rescale both to the larger lse. A side that saw nothing (lse -inf) weighs exactly 0 and its
  // out is never read (0 x NaN would be NaN: an empty split's out may hold anything). A side of
  // lse +inf outweighs any finite one: it takes all the weight (both +inf: half each).
  const at::Tensor top = at::maximum(lse_a, lse_b);
  const at::Tensor infinite_top = top == inf;
  const at::Tensor base = at::where(at::isinf(top), at::zeros_like(top), top).detach();
  auto weight_of = [&](const at::Tensor& lse) {
    // The exponent is taken where it is finite only, so that no branch of `where` carries an inf
    // (or its NaN gradient).
    const at::Tensor exponent = at::where(infinite_top, at::zeros_like(lse), lse - base);
    return at::where(infinite_top, (lse == inf).to(lse.scalar_type()), at::exp(exponent));
  };
  const at::Tensor weight_a = weight_of(lse_a), weight_b = weight_of(lse_b);
  const at::Tensor sum = weight_a + weight_b;
  const at::Tensor seen = sum > 0;
  const at::Tensor safe_sum = at::where(seen, sum, at::ones_like(sum));
  const at::ScalarType compute = out_a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto weighted = [&](const at::Tensor& side, const at::Tensor& weight) {
    const at::Tensor w = (weight / safe_sum).unsqueeze(-1).to(compute);
    // Masked before the product: the product's gradient then never multiplies by a NaN.
    return at::where(w > 0, side.to(compute), at::zeros({}, w.options())) * w;
  };
  const at::Tensor out =
      (weighted(out_a, weight_a) + weighted(out_b, weight_b)).to(out_a.scalar_type());
  const at::Tensor lse =
      at::where(infinite_top, at::full_like(sum, inf),
                at::where(seen, at::log(safe_sum) + base, at::full_like(sum, -inf)));
  return {out, lse};
}

}  // namespace astr
