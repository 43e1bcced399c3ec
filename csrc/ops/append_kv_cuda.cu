// Binding of the KV append kernel (csrc/kernels/append_kv.cu) to the op astr::append_kv.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "kernels/kv_cache/kv_cache.h"
#include "ops/append_kv_checks.h"
#include "support/check.h"
#include "support/kernel_settings.h"
#include "support/torch_scalar_type.h"

namespace astr {
namespace {

void check_rows(const at::Tensor& t, const char* name, int element_size) {
  ASTR_CHECK(t.stride(-1) == 1, name, ": the cuda append needs a contiguous last dim (stride 1), ",
             "got strides ", t.strides());
  ASTR_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
             ": the cuda append needs 16-byte aligned data");
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    ASTR_CHECK((t.stride(d) * element_size) % 16 == 0 || t.size(d) == 1, name,
               ": the cuda append needs strides that are multiples of 16 bytes, got ", t.strides());
}

// Mutable pools as at::Tensor& (schema Tensor(a!)): every kernel of one op must share one C++
// signature, and the CPU kernel (append_kv_cpu) takes them that way.
void append_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
               const std::optional<at::Tensor>& v_scale) {
  // The checks every device shares (one device, dtypes, shapes), then this kernel's own rules;
  // all before the launch, which writes both pools.
  astr::check_append_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  const bool fp8 = is_fp8(k_cache.scalar_type());
  const at::Device device = k.device();
  const at::ScalarType dtype = k.scalar_type();
  ASTR_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat, "k: dtype ",
             dtype, " is not supported by the cuda append (bfloat16, float16, float32)");
  ASTR_CHECK(slot_mapping.is_contiguous(), "slot_mapping: expected a contiguous tensor");
  const int element_size = static_cast<int>(k.element_size());
  for (auto [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}})
    ASTR_CHECK((t->size(2) * element_size) % 16 == 0, name, ": head_dim ", t->size(2),
               " times the element size must be a multiple of 16 bytes for the cuda append");
  check_rows(k, "k", element_size);
  check_rows(v, "v", element_size);
  const int pool_element_size = static_cast<int>(k_cache.element_size());
  check_rows(k_cache, "k_cache", pool_element_size);
  check_rows(v_cache, "v_cache", pool_element_size);
  if (fp8) {
    for (auto [scale, name] : {std::pair{&*k_scale, "k_scale"}, std::pair{&*v_scale, "v_scale"}})
      ASTR_CHECK(scale->is_contiguous(), name, ": expected a contiguous tensor");
    for (auto [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}})
      ASTR_CHECK((t->size(2) * pool_element_size) % 16 == 0, name, ": head_dim ", t->size(2),
                 " must be a multiple of 16 for an FP8 pool (16-byte rows)");
  }
  ASTR_CHECK(k.size(0) <= INT32_MAX, "k: ", k.size(0),
             " tokens is more than one cuda append takes");
  astr::check_pools_apart(k_cache, v_cache);
  // Reading slots and scales back is a host synchronisation: the checked mode's (csrc/README.md).
  if (astr::metadata_checks_enabled()) astr::check_append_kv_values(slot_mapping, k_scale, v_scale);

  kernels::AppendKVParams params{};
  params.k = k.data_ptr();
  params.v = v.data_ptr();
  params.k_cache = k_cache.data_ptr();
  params.v_cache = v_cache.data_ptr();
  params.slot_mapping = slot_mapping.data_ptr<int32_t>();
  params.k_stride_token = k.stride(0);
  params.k_stride_head = k.stride(1);
  params.v_stride_token = v.stride(0);
  params.v_stride_head = v.stride(1);
  params.k_cache_stride_page = k_cache.stride(0);
  params.k_cache_stride_slot = k_cache.stride(1);
  params.k_cache_stride_head = k_cache.stride(2);
  params.v_cache_stride_page = v_cache.stride(0);
  params.v_cache_stride_slot = v_cache.stride(1);
  params.v_cache_stride_head = v_cache.stride(2);
  params.num_tokens = static_cast<int>(k.size(0));
  params.num_kv_heads = static_cast<int>(k.size(1));
  params.head_dim = static_cast<int>(k.size(2));
  params.head_dim_v = static_cast<int>(v.size(2));
  params.page_size = static_cast<int>(k_cache.size(1));
  params.num_pages = k_cache.size(0);
  params.dtype = scalar_type_of(dtype);
  params.cache_dtype = scalar_type_of(k_cache.scalar_type());
  params.k_scale = fp8 ? k_scale->data_ptr<float>() : nullptr;
  params.v_scale = fp8 ? v_scale->data_ptr<float>() : nullptr;

  const c10::cuda::CUDAGuard guard(device);
  const kernels::LaunchStatus status =
      kernels::launch_append_kv(params, c10::cuda::getCurrentCUDAStream().stream());
  ASTR_CHECK(status.ok(), "append_kv: ", status.error);
}

}  // namespace

TORCH_LIBRARY_IMPL(astr, CUDA, m) { m.impl("append_kv", &append_kv); }

}  // namespace astr
