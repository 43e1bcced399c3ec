// The flash backend: the flash-attn package's own ops, found through the dispatcher once the
// Python probe has imported the package (which registers them).
#include <ATen/core/dispatch/Dispatcher.h>

#include "backends.h"

namespace astr {

at::Tensor flash_dense(const AttentionArgs& args) {
  (void)args;
  TORCH_CHECK(false, "flash backend: dense path not wired yet");
}

at::Tensor flash_paged(const AttentionArgs& args) {
  (void)args;
  TORCH_CHECK(false, "flash backend: paged path not wired yet");
}

}  // namespace astr
