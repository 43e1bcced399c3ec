// Binding of the latent append kernel (csrc/kernels/mla/append_mla.cu) to the op astr::append_mla.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <utility>

#include "kernels/mla/launch.h"
#include "ops/append_mla_checks.h"
#include "support/check.h"
#include "support/kernel_settings.h"
#include "support/torch_scalar_type.h"

namespace astr {
namespace {

// The kernel moves 16 bytes at a time: a contiguous last dim, 16-byte aligned rows.
void check_rows(const at::Tensor& t, const char* name) {
  ASTR_CHECK(t.stride(-1) == 1, name, ": the cuda append needs a contiguous last dim (stride 1), ",
             "got strides ", t.strides());
  ASTR_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
             ": the cuda append needs 16-byte aligned data");
  ASTR_CHECK((t.size(-1) * t.element_size()) % 16 == 0, name, ": rows of ", t.size(-1),
             " elements must be a multiple of 16 bytes for the cuda append");
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    ASTR_CHECK((t.stride(d) * t.element_size()) % 16 == 0 || t.size(d) == 1, name,
               ": the cuda append needs strides that are multiples of 16 bytes, got ", t.strides());
}

// Mutable pools as at::Tensor& (schema Tensor(a!)): every kernel of one op shares one signature.
void append_mla(const at::Tensor& ckv, const at::Tensor& krope, at::Tensor& ckv_cache,
                at::Tensor& krope_cache, const at::Tensor& slot_mapping,
                const std::optional<at::Tensor>& ckv_scale) {
  // Every check before the launch, which writes both pools.
  check_append_mla_args(ckv, krope, ckv_cache, krope_cache, slot_mapping, ckv_scale);
  const std::pair<const at::Tensor*, const char*> rows[] = {
      {&ckv, "ckv"}, {&krope, "krope"}, {&ckv_cache, "ckv_cache"}, {&krope_cache, "krope_cache"}};
  for (auto [t, name] : rows) check_rows(*t, name);
  ASTR_CHECK(slot_mapping.is_contiguous(), "slot_mapping: expected a contiguous tensor");
  ASTR_CHECK(ckv.size(0) <= INT32_MAX, "ckv: ", ckv.size(0),
             " tokens is more than one cuda append takes");
  check_mla_pools_apart(ckv_cache, krope_cache);
  // Reading slots and the scale back is a host synchronisation: the checked mode's.
  if (metadata_checks_enabled()) check_append_mla_values(slot_mapping, ckv_scale);

  kernels::AppendMlaParams p{};
  p.ckv = ckv.data_ptr();
  p.ckv_stride_token = ckv.stride(0);
  p.ckv_dtype = scalar_type_of(ckv.scalar_type());
  p.krope = krope.data_ptr();
  p.krope_stride_token = krope.stride(0);
  p.krope_dtype = scalar_type_of(krope.scalar_type());
  p.ckv_cache = ckv_cache.data_ptr();
  p.ckv_cache_stride_page = ckv_cache.stride(0);
  p.ckv_cache_stride_slot = ckv_cache.stride(1);
  p.ckv_cache_dtype = scalar_type_of(ckv_cache.scalar_type());
  p.ckv_scale = ckv_scale ? ckv_scale->data_ptr<float>() : nullptr;
  p.krope_cache = krope_cache.data_ptr();
  p.krope_cache_stride_page = krope_cache.stride(0);
  p.krope_cache_stride_slot = krope_cache.stride(1);
  p.slot_mapping = slot_mapping.data_ptr<int32_t>();
  p.num_tokens = static_cast<int>(ckv.size(0));
  p.latent_dim = static_cast<int>(ckv.size(1));
  p.rope_dim = static_cast<int>(krope.size(1));
  p.page_size = static_cast<int>(ckv_cache.size(1));
  p.num_pages = ckv_cache.size(0);

  const c10::cuda::CUDAGuard guard(ckv.device());
  const kernels::LaunchStatus status =
      kernels::launch_append_mla(p, c10::cuda::getCurrentCUDAStream().stream());
  ASTR_CHECK(status.ok(), "append_mla: ", status.error);
}

}  // namespace

TORCH_LIBRARY_IMPL(astr, CUDA, m) { m.impl("append_mla", &append_mla); }

}  // namespace astr
