// The cuda backend's latent attention as the resolver calls it: through the dispatcher to
// astr::cuda_mla_attention, whose CUDA kernel is backends/cuda/mla_attention.cu (and whose fake
// kernel torch.compile traces).
#include <ATen/core/dispatch/Dispatcher.h>

#include "backends/mla.h"

namespace astr {

AttentionResult cuda_mla(const MlaAttentionArgs& a) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("astr::cuda_mla_attention", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor& ASTR_MLA_ATTENTION_TYPES, bool)>();
#define ASTR_MLA_MEMBER_OF_A(name, type, default_value, cpp_type) , a.name
  auto [out, lse] = op.call(a.q_nope ASTR_MLA_ATTENTION_ARGS(ASTR_MLA_MEMBER_OF_A), a.return_lse);
#undef ASTR_MLA_MEMBER_OF_A
  return {out, a.return_lse ? lse : at::Tensor()};
}

}  // namespace astr
