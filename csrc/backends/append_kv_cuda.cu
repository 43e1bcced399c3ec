// Binding of the KV append kernel (csrc/kernels/append_kv.cu) to the op astr::append_kv.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "../check.h"
#include "../kernels/kv_cache/kv_cache.h"

namespace astrai::backends {
namespace {

void check_rows(const at::Tensor& t, const char* name, int element_size) {
  ASTR_CHECK(t.stride(-1) == 1, "append_kv: ", name,
             " must have a contiguous last dim (stride 1), got strides ", t.strides());
  ASTR_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "append_kv: ", name,
             " must be 16-byte aligned");
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    ASTR_CHECK((t.stride(d) * element_size) % 16 == 0 || t.size(d) == 1, "append_kv: ", name,
               " strides must be multiples of 16 bytes, got ", t.strides());
}

// Mutable pools as at::Tensor& (schema Tensor(a!)): every kernel of one op must share one C++
// signature, and the CPU kernel (append_kv_cpu) takes them that way.
void append_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping) {
  ASTR_CHECK(k.is_cuda(), "append_kv: k must be a CUDA tensor, got device ", k.device());
  const at::Device device = k.device();
  for (const auto& [t, name] : {std::pair{&v, "v"},
                                {&k_cache, "k_cache"},
                                {&v_cache, "v_cache"},
                                {&slot_mapping, "slot_mapping"}}) {
    ASTR_CHECK(t->is_cuda() && t->device() == device, "append_kv: ", name,
               " must be a CUDA tensor on ", device, " (the device of k), got ", t->device());
  }
  const at::ScalarType dtype = k.scalar_type();
  ASTR_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
             "append_kv: k must be bfloat16, float16 or float32, got ", dtype);
  for (const auto& [t, name] : {std::pair{&v, "v"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}})
    ASTR_CHECK(t->scalar_type() == dtype, "append_kv: ", name, " must have the dtype of k (", dtype,
               "), got ", t->scalar_type());
  ASTR_CHECK(k.dim() == 3, "append_kv: k must have shape [T, Hkv, D] (rank 3), got ", k.sizes());
  ASTR_CHECK(v.sizes() == k.sizes(), "append_kv: v shape ", v.sizes(), " must equal k shape ",
             k.sizes());
  ASTR_CHECK(k_cache.dim() == 4, "append_kv: k_cache must have shape [P, S, Hkv, D] (rank 4), got ",
             k_cache.sizes());
  ASTR_CHECK(v_cache.sizes() == k_cache.sizes(), "append_kv: v_cache shape ", v_cache.sizes(),
             " must equal k_cache shape ", k_cache.sizes());
  ASTR_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
             "append_kv: k_cache [P, S, Hkv, D] = ", k_cache.sizes(),
             " must match k [T, Hkv, D] = ", k.sizes(), " in Hkv and D");
  ASTR_CHECK(slot_mapping.scalar_type() == at::kInt, "append_kv: slot_mapping must be int32, got ",
             slot_mapping.scalar_type());
  ASTR_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0),
             "append_kv: slot_mapping must have shape [T] with T = ", k.size(0), ", got ",
             slot_mapping.sizes());
  ASTR_CHECK(slot_mapping.is_contiguous(), "append_kv: slot_mapping must be contiguous");
  const int element_size = static_cast<int>(k.element_size());
  ASTR_CHECK((k.size(2) * element_size) % 16 == 0, "append_kv: k head dim ", k.size(2),
             " times the element size must be a multiple of 16 bytes");
  check_rows(k, "k", element_size);
  check_rows(v, "v", element_size);
  check_rows(k_cache, "k_cache", element_size);
  check_rows(v_cache, "v_cache", element_size);
  ASTR_CHECK(k.size(0) <= INT32_MAX, "append_kv: too many tokens");

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
  params.page_size = static_cast<int>(k_cache.size(1));
  params.num_pages = k_cache.size(0);
  params.dtype = dtype == at::kBFloat16 ? kernels::ScalarType::kBFloat16
                 : dtype == at::kHalf   ? kernels::ScalarType::kFloat16
                                        : kernels::ScalarType::kFloat32;

  const c10::cuda::CUDAGuard guard(device);
  const kernels::LaunchStatus status =
      kernels::launch_append_kv(params, c10::cuda::getCurrentCUDAStream().stream());
  ASTR_CHECK(status.ok(), "append_kv: ", status.error);
}

}  // namespace

TORCH_LIBRARY_IMPL(astr, CUDA, m) { m.impl("append_kv", &append_kv); }

}  // namespace astrai::backends
