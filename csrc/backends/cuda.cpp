// The cuda backend as the resolver calls it: through the dispatcher to astr::cuda_paged_attention,
// whose CUDA kernel is backends/cuda/paged_attention.cu (and whose fake kernel torch.compile
// traces).
#include <ATen/core/dispatch/Dispatcher.h>

#include "backends/backends.h"

namespace astr {

AttentionResult cuda_paged(const AttentionArgs& a) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("astr::cuda_paged_attention", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor& ASTR_ATTENTION_TYPES, bool)>();
#define ASTR_ATTENTION_MEMBER_OF_A(name, type, default_value, cpp_type) , a.name
  auto [out, lse] = op.call(a.q ASTR_ATTENTION_ARGS(ASTR_ATTENTION_MEMBER_OF_A), a.return_lse);
#undef ASTR_ATTENTION_MEMBER_OF_A
  return {out, a.return_lse ? lse : at::Tensor()};
}

}  // namespace astr
