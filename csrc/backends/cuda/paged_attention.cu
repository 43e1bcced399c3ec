// Binding of the cuda backend's paged attention kernels (csrc/kernels/paged_attention/) to the op
// astr::cuda_paged_attention: tensors -> params -> plan -> launch. Checks every argument, fills
// the parameter struct, asks for the plan (plan.h: which form, splits, grid), launches on the
// current stream. No host synchronisation and no allocation that depends on tensor values: the
// decode path can be captured in a CUDA graph and replayed with new seq_lens.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

#include "kernels/kv_cache/kv_cache.h"
#include "kernels/paged_attention/config.h"
#include "kernels/paged_attention/launch.h"
#include "support/check.h"
#include "support/torch_scalar_type.h"
#include "support/kernel_settings.h"

namespace astr::backends {
namespace {

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  ASTR_CHECK(t.is_cuda(), "cuda_paged_attention: ", name, " must be a CUDA tensor, got device ",
             t.device());
  ASTR_CHECK(t.device() == device, "cuda_paged_attention: ", name, " must be on ", device,
             " (the device of q), got ", t.device());
}

void check_int32_vector(const at::Tensor& t, const char* name, int64_t expected_len,
                        const at::Device& device) {
  check_cuda_tensor(t, name, device);
  ASTR_CHECK(t.scalar_type() == at::kInt, "cuda_paged_attention: ", name, " must be int32, got ",
             t.scalar_type());
  ASTR_CHECK(t.dim() == 1 && t.size(0) == expected_len, "cuda_paged_attention: ", name,
             " must have shape [", expected_len, "], got ", t.sizes());
  ASTR_CHECK(t.stride(0) == 1 || t.size(0) <= 1, "cuda_paged_attention: ", name,
             " must be contiguous");
}

void check_float_vector(const at::Tensor& t, const char* name, int64_t expected_len,
                        const at::Device& device) {
  check_cuda_tensor(t, name, device);
  ASTR_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == expected_len,
             "cuda_paged_attention: ", name, " must be float32 of shape [", expected_len, "], got ",
             t.scalar_type(), " ", t.sizes());
  ASTR_CHECK(t.stride(0) == 1 || t.size(0) <= 1, "cuda_paged_attention: ", name,
             " must be contiguous");
}

// cp.async moves 16 bytes: base pointer and every stride must be multiples of 16 bytes.
void check_16_byte_rows(const at::Tensor& t, const char* name) {
  const int64_t per_16_bytes = 16 / t.element_size();
  ASTR_CHECK(t.stride(-1) == 1, "cuda_paged_attention: ", name,
             " must have a contiguous last dim (stride 1), got strides ", t.strides());
  ASTR_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "cuda_paged_attention: ", name,
             " must be 16-byte aligned");
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    ASTR_CHECK(t.stride(d) % per_16_bytes == 0 || t.size(d) == 1, "cuda_paged_attention: ", name,
               " strides must be multiples of 16 bytes, got ", t.strides());
}

int log2_of_power_of_two(int64_t value) {
  int log2 = 0;
  while ((int64_t{1} << log2) < value) ++log2;
  return log2;
}

std::tuple<at::Tensor, at::Tensor> cuda_paged_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    int64_t max_query_len, bool decode, const std::optional<at::Tensor>& attn_mask, bool is_causal,
    double scale, int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
    bool return_lse, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  ASTR_CHECK(q.is_cuda(), "cuda_paged_attention: q must be a CUDA tensor, got device ", q.device());
  const at::Device device = q.device();
  ASTR_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
             "cuda_paged_attention: q must be bfloat16 or float16, got ", q.scalar_type());
  ASTR_CHECK(q.dim() == 3, "cuda_paged_attention: q must have shape [T, Hq, D] (rank 3), got ",
             q.sizes());
  const int64_t num_tokens = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  ASTR_CHECK(kernels::paged_head_dim_forms(static_cast<int>(head_dim)) != nullptr,
             "cuda_paged_attention: q: ", kernels::unsupported_head_dim_message(head_dim));
  check_16_byte_rows(q, "q");

  // The cache holds q's dtype, or FP8 (e4m3 / e5m2, the same for k and v) with per-head scales.
  const bool fp8 = is_fp8(k_cache.scalar_type());
  for (const auto& [cache, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    check_cuda_tensor(*cache, name, device);
    ASTR_CHECK(cache->scalar_type() == q.scalar_type() ||
                   (fp8 && cache->scalar_type() == k_cache.scalar_type()),
               "cuda_paged_attention: ", name, " must have the dtype of q (", q.scalar_type(),
               ") or be an FP8 pool (float8_e4m3fn or float8_e5m2, both pools alike), got ",
               cache->scalar_type());
    ASTR_CHECK(cache->dim() == 4, "cuda_paged_attention: ", name,
               " must have shape [P, S, Hkv, D] (rank 4), got ", cache->sizes());
    ASTR_CHECK(cache->size(3) == head_dim, "cuda_paged_attention: ", name, " head dim ",
               cache->size(3), " must equal q's head dim ", head_dim);
    check_16_byte_rows(*cache, name);
  }
  ASTR_CHECK(v_cache.sizes() == k_cache.sizes(), "cuda_paged_attention: v_cache shape ",
             v_cache.sizes(), " must equal k_cache shape ", k_cache.sizes());
  const int64_t page_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  ASTR_CHECK(page_size >= 1 && (page_size & (page_size - 1)) == 0,
             "cuda_paged_attention: k_cache page size (dim 1) must be a power of two, got ",
             page_size);
  ASTR_CHECK(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0,
             "cuda_paged_attention: q heads (", num_q_heads,
             ") must be a multiple of k_cache kv heads (", num_kv_heads, ")");
  ASTR_CHECK(k_cache.size(0) >= 1 && k_cache.size(0) <= INT32_MAX,
             "cuda_paged_attention: k_cache must hold 1 to 2^31 - 1 pages, got ", k_cache.size(0));
  if (fp8) {
    ASTR_CHECK(k_scale.has_value() && v_scale.has_value(),
               "cuda_paged_attention: an FP8 KV cache needs k_scale and v_scale (float32 [Hkv])");
    check_float_vector(*k_scale, "k_scale", num_kv_heads, device);
    check_float_vector(*v_scale, "v_scale", num_kv_heads, device);
  } else {
    ASTR_CHECK(!k_scale && !v_scale,
               "cuda_paged_attention: k_scale/v_scale are only for an FP8 KV cache");
  }

  check_cuda_tensor(block_table, "block_table", device);
  ASTR_CHECK(block_table.scalar_type() == at::kInt,
             "cuda_paged_attention: block_table must be int32, got ", block_table.scalar_type());
  ASTR_CHECK(block_table.dim() == 2,
             "cuda_paged_attention: block_table must have shape [B, W], got ", block_table.sizes());
  ASTR_CHECK(block_table.stride(1) == 1 || block_table.size(1) <= 1,
             "cuda_paged_attention: block_table must have a contiguous last dim");
  const int64_t num_seqs = block_table.size(0);
  check_int32_vector(seq_lens, "seq_lens", num_seqs, device);
  if (decode) {
    ASTR_CHECK(num_tokens == num_seqs,
               "cuda_paged_attention: decode needs one token per sequence: q has ", num_tokens,
               " tokens, block_table has ", num_seqs, " sequences");
  } else {
    check_int32_vector(query_start_loc, "query_start_loc", num_seqs + 1, device);
    ASTR_CHECK(max_query_len >= 0, "cuda_paged_attention: max_query_len must be >= 0, got ",
               max_query_len);
    ASTR_CHECK(num_tokens == 0 || max_query_len > 0,
               "cuda_paged_attention: max_query_len must be >= 1 when q has tokens");
  }
  const bool* mask_ptr = nullptr;
  int64_t mask_stride = 0, mask_kv_len = 0;
  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    check_cuda_tensor(mask, "attn_mask", device);
    ASTR_CHECK(mask.scalar_type() == at::kBool,
               "cuda_paged_attention: attn_mask must be bool (True = attend), got ",
               mask.scalar_type());
    ASTR_CHECK(mask.dim() == 2 && mask.size(0) == num_tokens,
               "cuda_paged_attention: attn_mask must have shape [T, K] with T = ", num_tokens,
               ", got ", mask.sizes());
    ASTR_CHECK(mask.stride(1) == 1 || mask.size(1) <= 1,
               "cuda_paged_attention: attn_mask must have a contiguous last dim");
    mask_ptr = mask.data_ptr<bool>();
    mask_stride = mask.stride(0);
    mask_kv_len = mask.size(1);
  }
  ASTR_CHECK(window_left >= -1 && window_left <= INT32_MAX,
             "cuda_paged_attention: window_left must be -1 or in [0, 2^31 - 1], got ", window_left);
  ASTR_CHECK(std::isfinite(softcap) && softcap >= 0.0,
             "cuda_paged_attention: softcap must be 0 (off) or a finite value > 0, got ", softcap);
  if (sinks) check_float_vector(*sinks, "sinks", num_q_heads, device);
  ASTR_CHECK(num_tokens <= INT32_MAX && num_seqs <= INT32_MAX,
             "cuda_paged_attention: too many tokens");

  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({num_tokens, num_q_heads, head_dim}, q.options());
  at::Tensor lse = return_lse ? at::empty({num_tokens, num_q_heads}, q.options().dtype(at::kFloat))
                              : at::empty({0}, q.options().dtype(at::kFloat));
  if (num_tokens == 0) return {out, lse};

  kernels::PagedAttentionParams base{};
  base.q = q.data_ptr();
  base.q_stride_token = q.stride(0);
  base.q_stride_head = q.stride(1);
  base.q_dtype = scalar_type_of(q.scalar_type());
  base.k_cache = k_cache.data_ptr();
  base.v_cache = v_cache.data_ptr();
  base.k_stride_page = k_cache.stride(0);
  base.k_stride_slot = k_cache.stride(1);
  base.k_stride_head = k_cache.stride(2);
  base.v_stride_page = v_cache.stride(0);
  base.v_stride_slot = v_cache.stride(1);
  base.v_stride_head = v_cache.stride(2);
  base.kv_dtype = scalar_type_of(k_cache.scalar_type());
  base.num_pages = static_cast<int>(k_cache.size(0));
  base.k_scale = fp8 ? k_scale->data_ptr<float>() : nullptr;
  base.v_scale = fp8 ? v_scale->data_ptr<float>() : nullptr;
  base.block_table = block_table.data_ptr<int32_t>();
  base.block_table_stride = block_table.stride(0);
  base.block_table_width = static_cast<int>(std::min<int64_t>(block_table.size(1), INT32_MAX));
  base.seq_lens = seq_lens.data_ptr<int32_t>();
  base.attn_mask = mask_ptr;
  base.mask_stride_token = mask_stride;
  base.mask_kv_len = static_cast<int>(std::min<int64_t>(mask_kv_len, INT32_MAX));
  base.window_left = static_cast<int>(window_left);
  base.softcap = static_cast<float>(softcap);
  base.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  base.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  base.lse_stride_token = num_q_heads;
  base.out = out.data_ptr();
  base.out_stride_token = out.stride(0);
  base.out_stride_head = out.stride(1);
  base.num_seqs = static_cast<int>(num_seqs);
  base.num_tokens = static_cast<int>(num_tokens);
  base.num_q_heads = static_cast<int>(num_q_heads);
  base.num_kv_heads = static_cast<int>(num_kv_heads);
  base.head_dim = static_cast<int>(head_dim);
  base.log2_page_size = log2_of_power_of_two(page_size);
  base.is_causal = is_causal;
  base.scale = static_cast<float>(scale);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const kernels::DeviceFacts device_facts = kernels::current_device_facts();
  const kernels::KernelTuning tuning = astr::current_kernel_tuning();
  kernels::LaunchStatus status;
  if (decode) {
    kernels::PagedDecodeParams params{};
    static_cast<kernels::PagedAttentionParams&>(params) = base;
    kernels::DecodeShape shape;
    shape.num_seqs = base.num_seqs;
    shape.num_q_heads = base.num_q_heads;
    shape.num_kv_heads = base.num_kv_heads;
    shape.head_dim = base.head_dim;
    shape.block_table_positions = block_table.size(1) * page_size;
    shape.window_left = base.window_left;
    shape.kv_bytes = static_cast<int>(k_cache.element_size());
    const kernels::DecodePlan plan = kernels::plan_paged_decode(shape, device_facts, tuning);
    ASTR_CHECK(plan.error.empty(), "cuda_paged_attention: ", plan.error);
    // Sized from shapes only (split count, T, Hq, D), never from seq_lens' values.
    at::Tensor workspace;
    if (plan.workspace_floats > 0) {
      workspace =
          at::empty({static_cast<int64_t>(plan.workspace_floats)}, q.options().dtype(at::kFloat));
      params.workspace = workspace.data_ptr<float>();
    }
    // The persistent decode's claim counter, which the launch zeroes in the stream (also inside
    // a captured graph).
    at::Tensor claim_counter;
    if (plan.form == kernels::DecodeForm::kPersistent) {
      claim_counter = at::empty({1}, q.options().dtype(at::kInt));
      params.persistent_claim_counter = claim_counter.data_ptr<int32_t>();
    }
    status = kernels::launch_paged_decode(params, plan, stream);
  } else {
    kernels::PagedPrefillParams params{};
    static_cast<kernels::PagedAttentionParams&>(params) = base;
    // An FP8 cache: the plan says whether the pages this prefill reads are dequantized first into
    // pools of q's dtype (page w of sequence b at b * W + w; the scales applied there), which the
    // kernel then reads as a 16-bit cache, or the kernel reads the bytes (plan.h,
    // prefill_dequantizes_fp8_first has the rule and its measurements).
    const int64_t width = block_table.size(1);
    const int64_t pages = num_seqs * width;
    std::optional<int64_t> scratch_bytes;  // none: a 16-bit cache
    if (fp8) scratch_bytes = 2 * pages * page_size * num_kv_heads * head_dim * q.element_size();
    // The K/V one (sequence, kv head) pair may read, for the block order: the element the
    // kernel reads (q's dtype where an FP8 cache is dequantized first: counted as 2 bytes).
    kernels::PrefillKvFootprint footprint;
    footprint.pairs = num_seqs * num_kv_heads;
    footprint.bytes_per_pair = 2 * width * page_size * head_dim * q.element_size();
    const kernels::PrefillPlan plan =
        kernels::plan_paged_prefill(base.head_dim, device_facts, tuning, scratch_bytes, footprint);
    at::Tensor k_pages, v_pages, pages_table;
    if (fp8 && plan.error.empty() && plan.dequantize_fp8_first) {
      k_pages = at::empty({pages, page_size, num_kv_heads, head_dim}, q.options());
      v_pages = at::empty_like(k_pages);
      pages_table = at::arange(pages, block_table.options()).view({num_seqs, width});
      kernels::DequantizePagesParams dequantize{};
      dequantize.k_cache = k_cache.data_ptr();
      dequantize.v_cache = v_cache.data_ptr();
      dequantize.k_stride_page = k_cache.stride(0);
      dequantize.k_stride_slot = k_cache.stride(1);
      dequantize.k_stride_head = k_cache.stride(2);
      dequantize.v_stride_page = v_cache.stride(0);
      dequantize.v_stride_slot = v_cache.stride(1);
      dequantize.v_stride_head = v_cache.stride(2);
      dequantize.cache_dtype = base.kv_dtype;
      dequantize.k_scale = base.k_scale;
      dequantize.v_scale = base.v_scale;
      dequantize.block_table = base.block_table;
      dequantize.block_table_stride = base.block_table_stride;
      dequantize.seq_lens = base.seq_lens;
      dequantize.k_out = k_pages.data_ptr();
      dequantize.v_out = v_pages.data_ptr();
      dequantize.out_dtype = base.q_dtype;
      dequantize.num_seqs = base.num_seqs;
      dequantize.width = static_cast<int>(width);
      dequantize.page_size = static_cast<int>(page_size);
      dequantize.num_kv_heads = base.num_kv_heads;
      dequantize.head_dim = base.head_dim;
      dequantize.num_pages = k_cache.size(0);
      const kernels::LaunchStatus dequantized =
          kernels::launch_dequantize_pages(dequantize, stream);
      ASTR_CHECK(dequantized.ok(), "cuda_paged_attention: ", dequantized.error);
      ASTR_CHECK(pages <= INT32_MAX, "cuda_paged_attention: too many pages for an FP8 prefill");
      params.k_cache = k_pages.data_ptr();
      params.v_cache = v_pages.data_ptr();
      params.k_stride_page = k_pages.stride(0);
      params.k_stride_slot = k_pages.stride(1);
      params.k_stride_head = k_pages.stride(2);
      params.v_stride_page = v_pages.stride(0);
      params.v_stride_slot = v_pages.stride(1);
      params.v_stride_head = v_pages.stride(2);
      params.kv_dtype = base.q_dtype;
      params.num_pages = static_cast<int>(pages);
      params.k_scale = params.v_scale = nullptr;
      params.block_table = pages_table.data_ptr<int32_t>();
      params.block_table_stride = pages_table.stride(0);
    }
    params.query_start_loc = query_start_loc.data_ptr<int32_t>();
    params.max_query_len = static_cast<int>(std::min<int64_t>(max_query_len, INT32_MAX));
    status = kernels::launch_paged_prefill(params, plan, stream);
  }
  ASTR_CHECK(status.ok(), "cuda_paged_attention: ", status.error);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(astr, CUDA, m) { m.impl("cuda_paged_attention", &cuda_paged_attention); }

}  // namespace astr::backends
