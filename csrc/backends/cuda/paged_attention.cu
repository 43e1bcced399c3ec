// The cuda backend's op, astr::cuda_paged_attention (CUDA key): checks (paged_attention_checks),
// params (paged_attention_params), then the plan and its launch on the current stream. No host
// synchronisation and no allocation sized by tensor values: a decode can be captured in a CUDA
// graph and replayed with new seq_lens.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

#include "backends/cuda/paged_attention_checks.h"
#include "backends/cuda/paged_attention_params.h"
#include "kernels/kv_cache/kv_cache.h"
#include "kernels/paged_attention/launch.h"
#include "kernels/paged_attention/prefill_tile_scheduler.h"
#include "support/check.h"
#include "support/kernel_settings.h"

namespace astr::backends {
namespace {

// The decode forms' plan for a decode, or for a verify (verify_len > 0: its max_query_len).
kernels::DecodePlan plan_decode(const PagedCallShape& shape, const AttentionArgs& args,
                                const kernels::DeviceFacts& device,
                                const kernels::KernelTuning& tuning, bool batch_invariant,
                                int verify_len) {
  kernels::DecodeShape decode = decode_shape(shape, args);
  decode.batch_invariant = batch_invariant;
  if (verify_len > 0) {
    decode.query_len = verify_len;
    decode.num_tokens = shape.num_tokens;
  }
  return kernels::plan_paged_decode(decode, device, tuning);
}

// A decode, or a verify (a prefill-mode call the plan gives the decode forms: verify_len, its
// max_query_len, > 0).
kernels::LaunchStatus launch_decode(const kernels::PagedAttentionParams& base,
                                    const PagedCallShape& shape, const AttentionArgs& args,
                                    const kernels::DeviceFacts& device,
                                    const kernels::KernelTuning& tuning, bool batch_invariant,
                                    int verify_len, cudaStream_t stream) {
  kernels::PagedVerifyParams params{};
  static_cast<kernels::PagedAttentionParams&>(params) = base;
  const kernels::DecodePlan plan =
      plan_decode(shape, args, device, tuning, batch_invariant, verify_len);
  ASTR_CHECK(plan.error.empty(), "cuda_paged_attention: ", plan.error);
  const at::TensorOptions floats = args.q.options().dtype(at::kFloat);
  // Sized from shapes only (split count, T, Hq, D), never from seq_lens' values.
  at::Tensor workspace;
  if (plan.workspace_floats > 0) {
    workspace = at::empty({static_cast<int64_t>(plan.workspace_floats)}, floats);
    params.workspace = workspace.data_ptr<float>();
  }
  // The persistent decode's claim counter, zeroed by the launch in the stream (also inside a
  // captured graph).
  at::Tensor claim_counter;
  if (plan.form == kernels::DecodeForm::kPersistent) {
    claim_counter = at::empty({1}, args.q.options().dtype(at::kInt));
    params.persistent_claim_counter = claim_counter.data_ptr<int32_t>();
  }
  if (verify_len == 0) return kernels::launch_paged_decode(params, plan, stream);
  params.query_start_loc = args.query_start_loc->data_ptr<int32_t>();
  params.max_query_len = verify_len;
  return kernels::launch_paged_verify(params, plan, stream);
}

// The pages a prefill reads of an FP8 cache, dequantized into pools of q's dtype (page w of
// sequence b at b * W + w, the scales applied), which the kernel then reads as a 16-bit cache.
struct DequantizedPages {
  at::Tensor k_pages, v_pages, block_table;
};

DequantizedPages dequantize_pages(kernels::PagedPrefillParams& params, const PagedCallShape& shape,
                                  const AttentionArgs& args, cudaStream_t stream) {
  const at::Tensor& k_cache = *args.k_cache;
  const at::Tensor& v_cache = *args.v_cache;
  const int64_t pages = shape.num_seqs * shape.width;
  ASTR_CHECK(pages <= INT32_MAX, "cuda_paged_attention: too many pages for an FP8 prefill");
  // The plan reads the bytes where v's head dim differs (plan_paged_prefill).
  ASTR_CHECK(shape.head_dim_v == shape.head_dim,
             "cuda_paged_attention: FP8 pages are dequantized first for equal head dims only");
  DequantizedPages out;
  out.k_pages =
      at::empty({pages, shape.page_size, shape.num_kv_heads, shape.head_dim}, args.q.options());
  out.v_pages = at::empty_like(out.k_pages);
  out.block_table =
      at::arange(pages, args.block_table->options()).view({shape.num_seqs, shape.width});
  kernels::DequantizePagesParams dequantize{};
  point_at_pools(dequantize, k_cache, v_cache);
  dequantize.cache_dtype = params.kv_dtype;
  dequantize.k_scale = params.k_scale;
  dequantize.v_scale = params.v_scale;
  dequantize.block_table = params.block_table;
  dequantize.block_table_stride = params.block_table_stride;
  dequantize.seq_lens = params.seq_lens;
  dequantize.k_out = out.k_pages.data_ptr();
  dequantize.v_out = out.v_pages.data_ptr();
  dequantize.out_dtype = params.q_dtype;
  dequantize.num_seqs = params.num_seqs;
  dequantize.width = static_cast<int>(shape.width);
  dequantize.page_size = static_cast<int>(shape.page_size);
  dequantize.num_kv_heads = params.num_kv_heads;
  dequantize.head_dim = params.head_dim;
  dequantize.num_pages = shape.num_pages;
  const kernels::LaunchStatus status = kernels::launch_dequantize_pages(dequantize, stream);
  ASTR_CHECK(status.ok(), "cuda_paged_attention: ", status.error);
  point_at_pools(params, out.k_pages, out.v_pages);
  params.kv_dtype = params.q_dtype;
  params.num_pages = static_cast<int>(pages);
  params.k_scale = params.v_scale = nullptr;
  params.block_table = out.block_table.data_ptr<int32_t>();
  params.block_table_stride = out.block_table.stride(0);
  return out;
}

kernels::PrefillPlan plan_prefill(const PagedCallShape& shape, const AttentionArgs& args,
                                  const kernels::DeviceFacts& device,
                                  const kernels::KernelTuning& tuning, bool batch_invariant) {
  const int64_t q_bytes = args.q.element_size();
  // An FP8 cache: the plan says whether its pages are dequantized first (within a scratch limit)
  // or the kernel reads the bytes.
  std::optional<int64_t> scratch_bytes;  // none: a 16-bit cache
  if (shape.fp8) {
    scratch_bytes = shape.num_seqs * shape.width * shape.page_size * shape.num_kv_heads *
                    (shape.head_dim + shape.head_dim_v) * q_bytes;
  }
  return kernels::plan_paged_prefill(static_cast<int>(shape.head_dim), device, tuning,
                                     scratch_bytes, prefill_kv_footprint(shape, q_bytes),
                                     batch_invariant, static_cast<int>(shape.head_dim_v));
}

kernels::LaunchStatus launch_prefill(const kernels::PagedAttentionParams& base,
                                     const PagedCallShape& shape, const AttentionArgs& args,
                                     const kernels::DeviceFacts& device,
                                     const kernels::KernelTuning& tuning, bool batch_invariant,
                                     cudaStream_t stream) {
  kernels::PagedPrefillParams params{};
  static_cast<kernels::PagedAttentionParams&>(params) = base;
  const kernels::PrefillPlan plan = plan_prefill(shape, args, device, tuning, batch_invariant);
  DequantizedPages dequantized;  // alive until the launch is queued
  if (shape.fp8 && plan.error.empty() && plan.dequantize_fp8_first) {
    dequantized = dequantize_pages(params, shape, args, stream);
  }
  params.query_start_loc = args.query_start_loc->data_ptr<int32_t>();
  params.max_query_len = static_cast<int>(std::min<int64_t>(args.max_query_len, INT32_MAX));
  // The persistent prefill's item order and claim counter, written by its launch in the stream
  // (also inside a captured graph); sized from shapes only (B, max_query_len, the group).
  at::Tensor schedule;
  if (plan.error.empty() && plan.kernel == kernels::PrefillKernel::kPersistent) {
    const int64_t row_tiles = kernels::prefill_grid_row_tiles(
        params.max_query_len, shape.num_q_heads / shape.num_kv_heads,
        kernels::kPersistentPrefillRows);
    ASTR_CHECK(shape.num_seqs * row_tiles * shape.num_kv_heads <= INT32_MAX,
               "cuda_paged_attention: too many prefill items for the persistent kernel (",
               shape.num_seqs, " sequences x ", row_tiles, " row tiles x ", shape.num_kv_heads,
               " kv heads)");
    schedule = at::empty({kernels::prefill_schedule_ints(shape.num_seqs, row_tiles)},
                         args.q.options().dtype(at::kInt));
    params.schedule_workspace = schedule.data_ptr<int32_t>();
  }
  return kernels::launch_paged_prefill(params, plan, stream);
}

kernels::TopkPlan plan_topk(const PagedCallShape& shape, const AttentionArgs& args,
                            const kernels::DeviceFacts& device, const kernels::KernelTuning& tuning,
                            bool batch_invariant) {
  kernels::TopkShape topk = topk_shape(shape, args);
  topk.batch_invariant = batch_invariant;
  return kernels::plan_paged_topk(topk, device, tuning);
}

// Sparse top-k attention, decode or prefill: the listing pass' scratch and the split workspace
// are sized from shapes only (T, topk, the split count).
kernels::LaunchStatus launch_topk(const kernels::PagedAttentionParams& base,
                                  const PagedCallShape& shape, const AttentionArgs& args,
                                  const kernels::DeviceFacts& device,
                                  const kernels::KernelTuning& tuning, bool batch_invariant,
                                  cudaStream_t stream) {
  kernels::PagedTopkParams params{};
  static_cast<kernels::PagedAttentionParams&>(params) = base;
  const kernels::TopkPlan plan = plan_topk(shape, args, device, tuning, batch_invariant);
  ASTR_CHECK(plan.error.empty(), "cuda_paged_attention: ", plan.error);
  const at::Tensor listed =
      at::empty({shape.num_tokens, args.topk_indices->size(1)}, args.q.options().dtype(at::kInt));
  params.listed_positions = listed.data_ptr<int32_t>();
  at::Tensor workspace;
  if (plan.workspace_floats > 0) {
    workspace = at::empty({static_cast<int64_t>(plan.workspace_floats)},
                          args.q.options().dtype(at::kFloat));
    params.workspace = workspace.data_ptr<float>();
  }
  if (!args.decode()) {
    params.query_start_loc = args.query_start_loc->data_ptr<int32_t>();
    params.max_query_len = static_cast<int>(std::min<int64_t>(args.max_query_len, INT32_MAX));
  }
  return kernels::launch_paged_topk(params, plan, stream);
}

std::tuple<at::Tensor, at::Tensor> cuda_paged_attention(const at::Tensor& q ASTR_ATTENTION_PARAMS,
                                                        bool return_lse) {
  const AttentionArgs args(q ASTR_ATTENTION_FORWARDED, return_lse);
  const PagedCallShape shape = check_cuda_paged_call(args);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({shape.num_tokens, shape.num_q_heads, shape.head_dim_v}, q.options());
  const at::TensorOptions floats = q.options().dtype(at::kFloat);
  at::Tensor lse = return_lse ? at::empty({shape.num_tokens, shape.num_q_heads}, floats)
                              : at::empty({0}, floats);
  if (shape.num_tokens == 0) return {out, lse};
  const kernels::PagedAttentionParams base =
      paged_attention_params(args, shape, out, return_lse ? lse : at::Tensor());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const kernels::DeviceFacts device = kernels::current_device_facts();
  const kernels::KernelTuning tuning = current_kernel_tuning();
  const bool invariant = batch_invariant_enabled();
  const int64_t new_tokens_bound = std::min<int64_t>(args.max_query_len, INT32_MAX);
  kernels::LaunchStatus status;
  if (args.topk_indices) {
    status = launch_topk(base, shape, args, device, tuning, invariant, stream);
  } else if (args.decode()) {
    status = launch_decode(base, shape, args, device, tuning, invariant, 0, stream);
  } else if (kernels::prefill_runs_as_verify(new_tokens_bound, tuning, invariant)) {
    status = launch_decode(base, shape, args, device, tuning, invariant,
                           static_cast<int>(new_tokens_bound), stream);
  } else {
    status = launch_prefill(base, shape, args, device, tuning, invariant, stream);
  }
  ASTR_CHECK(status.ok(), "cuda_paged_attention: ", status.error);
  return {out, lse};
}

// What the plan picks for this call, as "decode/split x13", "prefill/warp_specialized" or
// "topk/split x4" (the kernel table's words, kernels::describe_plan); the plan's error where no
// form can run it. Computes the plan only: no allocation, no launch.
std::string cuda_paged_plan(const at::Tensor& q ASTR_ATTENTION_PARAMS) {
  const AttentionArgs args(q ASTR_ATTENTION_FORWARDED, /*return_lse=*/false);
  const PagedCallShape shape = check_cuda_paged_call(args);
  const c10::cuda::CUDAGuard guard(q.device());
  const kernels::DeviceFacts device = kernels::current_device_facts();
  const kernels::KernelTuning tuning = current_kernel_tuning();
  const bool invariant = batch_invariant_enabled();
  if (args.topk_indices) {
    const kernels::TopkPlan plan = plan_topk(shape, args, device, tuning, invariant);
    return plan.error.empty() ? "topk/" + kernels::describe_plan(plan) : plan.error;
  }
  const int64_t new_tokens_bound = std::min<int64_t>(args.max_query_len, INT32_MAX);
  const bool verify =
      !args.decode() && kernels::prefill_runs_as_verify(new_tokens_bound, tuning, invariant);
  if (args.decode() || verify) {
    const kernels::DecodePlan plan = plan_decode(shape, args, device, tuning, invariant,
                                                 verify ? static_cast<int>(new_tokens_bound) : 0);
    return plan.error.empty() ? (verify ? "verify/" : "decode/") + kernels::describe_plan(plan)
                              : plan.error;
  }
  const kernels::PrefillPlan plan = plan_prefill(shape, args, device, tuning, invariant);
  return plan.error.empty() ? "prefill/" + kernels::describe_plan(plan, shape.fp8) : plan.error;
}

}  // namespace

TORCH_LIBRARY_IMPL(astr, CUDA, m) {
  m.impl("cuda_paged_attention", &cuda_paged_attention);
  m.impl("cuda_paged_plan", &cuda_paged_plan);
}

}  // namespace astr::backends
