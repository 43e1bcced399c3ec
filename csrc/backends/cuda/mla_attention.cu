// The cuda backend's latent attention, astr::cuda_mla_attention (CUDA key): the op's own checks
// (direct calls reach it without the resolver), the capability rules of the cuda backend for the
// kernel's limits, then params, plan and launch on the current stream. No host synchronisation
// (but in the checked mode) and no allocation sized by tensor values: a decode can be captured in
// a CUDA graph and replayed with new seq_lens.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "dispatch/capability.h"
#include "kernels/mla/launch.h"
#include "kernels/paged_attention/launch.h"  // current_device_facts
#include "ops/mla_attention_args.h"
#include "support/check.h"
#include "support/kernel_settings.h"
#include "support/torch_scalar_type.h"

namespace astr::backends {
namespace {

void check_aligned(const at::Tensor& t, const char* name) {
  ASTR_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "cuda_mla_attention: ", name,
             " must be 16-byte aligned");
}

void check_contiguous_metadata(const at::Tensor& t, const char* name) {
  ASTR_CHECK(t.is_cuda(), "cuda_mla_attention: ", name, " must be a CUDA tensor, got device ",
             t.device());
  ASTR_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, "cuda_mla_attention: ", name,
             " must have a contiguous last dim, got strides ", t.strides());
}

// The op's validation, then what the kernel takes (the cuda backend's capability rules for a
// latent call: dtype, dims 512 and 64, page size, layout; csrc/kernels/mla/config.h).
void check_cuda_mla_call(const MlaAttentionArgs& a) {
  const dispatch::CallDescription call = validate_and_describe_mla(a);
  ASTR_CHECK(a.q_nope.is_cuda(), "cuda_mla_attention: q_nope must be a CUDA tensor, got device ",
             a.q_nope.device());
  const auto reasons =
      dispatch::rejection_reasons(dispatch::Backend::kCuda, call, {}, dispatch::Checks::kForm);
  std::string text;
  for (const auto& reason : reasons) text += (text.empty() ? "" : "; ") + reason;
  ASTR_CHECK(reasons.empty(), "cuda_mla_attention: ", text);
  const std::pair<const at::Tensor*, const char*> rows[] = {{&a.q_nope, "q_nope"},
                                                            {&a.q_rope, "q_rope"},
                                                            {&a.ckv_cache, "ckv_cache"},
                                                            {&a.krope_cache, "krope_cache"}};
  for (auto [t, name] : rows) check_aligned(*t, name);
  check_contiguous_metadata(a.block_table, "block_table");
  check_contiguous_metadata(a.seq_lens, "seq_lens");
  check_contiguous_metadata(a.query_start_loc, "query_start_loc");
  if (a.ckv_scale) check_contiguous_metadata(*a.ckv_scale, "ckv_scale");
  ASTR_CHECK(a.ckv_cache.size(0) <= INT32_MAX, "cuda_mla_attention: ckv_cache must hold at most ",
             "2^31 - 1 pages, got ", a.ckv_cache.size(0));
  ASTR_CHECK(a.q_nope.size(0) <= INT32_MAX && a.seq_lens.size(0) <= INT32_MAX &&
                 a.block_table.size(1) <= INT32_MAX,
             "cuda_mla_attention: too many tokens, sequences or block-table columns");
}

kernels::MlaAttentionParams mla_params(const MlaAttentionArgs& a, const at::Tensor& out,
                                       const at::Tensor& lse) {
  kernels::MlaAttentionParams p{};
  p.q_nope = a.q_nope.data_ptr();
  p.q_nope_stride_token = a.q_nope.stride(0);
  p.q_nope_stride_head = a.q_nope.stride(1);
  p.q_rope = a.q_rope.data_ptr();
  p.q_rope_stride_token = a.q_rope.stride(0);
  p.q_rope_stride_head = a.q_rope.stride(1);
  p.q_dtype = scalar_type_of(a.q_nope.scalar_type());
  p.ckv_cache = a.ckv_cache.data_ptr();
  p.ckv_stride_page = a.ckv_cache.stride(0);
  p.ckv_stride_slot = a.ckv_cache.stride(1);
  p.ckv_dtype = scalar_type_of(a.ckv_cache.scalar_type());
  p.ckv_scale = a.ckv_scale ? a.ckv_scale->data_ptr<float>() : nullptr;
  p.krope_cache = a.krope_cache.data_ptr();
  p.krope_stride_page = a.krope_cache.stride(0);
  p.krope_stride_slot = a.krope_cache.stride(1);
  p.num_pages = static_cast<int>(a.ckv_cache.size(0));
  p.page_size = static_cast<int>(a.ckv_cache.size(1));
  p.block_table = a.block_table.data_ptr<int32_t>();
  p.block_table_stride = a.block_table.stride(0);
  p.block_table_width = static_cast<int>(a.block_table.size(1));
  p.seq_lens = a.seq_lens.data_ptr<int32_t>();
  p.query_start_loc = a.query_start_loc.data_ptr<int32_t>();
  p.decode = a.decode();
  // Any bound on the new tokens of one sequence works; the call's token count is one.
  const int64_t tokens = std::max<int64_t>(a.q_nope.size(0), 1);
  p.max_query_len = a.decode() ? 1 : static_cast<int>(std::min(a.max_query_len, tokens));
  p.out = out.data_ptr();
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.lse = lse.defined() ? lse.data_ptr<float>() : nullptr;
  p.lse_stride_token = lse.defined() ? lse.stride(0) : 0;
  p.num_seqs = static_cast<int>(a.seq_lens.size(0));
  p.num_tokens = static_cast<int>(a.q_nope.size(0));
  p.num_heads = static_cast<int>(a.q_nope.size(1));
  p.is_causal = a.is_causal;
  p.scale = static_cast<float>(a.scale);
  return p;
}

// The plan's inputs: shapes and host bounds only (the block table's width, never seq_lens'
// values), so that a captured graph replays one launch configuration for every length.
kernels::MlaPlan mla_plan(const MlaAttentionArgs& a, const kernels::MlaAttentionParams& params) {
  kernels::MlaCallShape shape;
  shape.num_seqs = params.num_seqs;
  shape.max_query_len = params.max_query_len;
  shape.num_heads = params.num_heads;
  shape.decode = a.decode();
  shape.fp8 = params.ckv_dtype == ScalarType::kFloat8E4M3;
  shape.max_seq_len = a.block_table.size(1) * a.ckv_cache.size(1);
  shape.num_tokens = params.num_tokens;
  return kernels::plan_mla_attention(shape, kernels::current_device_facts(),
                                     current_kernel_tuning());
}

std::tuple<at::Tensor, at::Tensor> cuda_mla_attention(
    const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS, bool return_lse) {
  const MlaAttentionArgs args(q_nope ASTR_MLA_ATTENTION_FORWARDED, return_lse);
  check_cuda_mla_call(args);
  const c10::cuda::CUDAGuard guard(q_nope.device());
  const int64_t tokens = q_nope.size(0), heads = q_nope.size(1);
  at::Tensor out = at::empty({tokens, heads, q_nope.size(2)}, q_nope.options());
  const at::TensorOptions floats = q_nope.options().dtype(at::kFloat);
  at::Tensor lse = return_lse ? at::empty({tokens, heads}, floats) : at::empty({0}, floats);
  if (tokens == 0) return {out, lse};
  const kernels::MlaAttentionParams params = mla_params(args, out, return_lse ? lse : at::Tensor());
  const kernels::MlaPlan plan = mla_plan(args, params);
  // The splits' partial results: sized by the plan's split count and the call's shape.
  at::Tensor partial_out, partial_lse;
  kernels::MlaSplitWorkspace workspace;
  if (plan.kernel == kernels::MlaKernel::kTensorCore && plan.num_splits > 1) {
    partial_out = at::empty({plan.num_splits, tokens * heads, q_nope.size(2)}, floats);
    partial_lse = at::empty({plan.num_splits, tokens * heads}, floats);
    workspace = {partial_out.data_ptr<float>(), partial_lse.data_ptr<float>()};
  }
  const kernels::LaunchStatus status = kernels::launch_mla_attention(
      params, plan, workspace, c10::cuda::getCurrentCUDAStream().stream());
  ASTR_CHECK(status.ok(), "cuda_mla_attention: ", status.error);
  return {out, lse};
}

// Which kernel the cuda backend's plan picks for such a call ("tensor_core/split x4",
// "tensor_core", "simple"; kernels::describe_plan), or the plan's error. The plan only: no
// allocation, no launch.
std::string cuda_mla_plan(const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS) {
  const MlaAttentionArgs args(q_nope ASTR_MLA_ATTENTION_FORWARDED, /*return_lse=*/false);
  check_cuda_mla_call(args);
  const c10::cuda::CUDAGuard guard(q_nope.device());
  // An output of no tokens in the call's layout: the params read its strides.
  const at::Tensor out = at::empty({0, q_nope.size(1), q_nope.size(2)}, q_nope.options());
  const kernels::MlaPlan plan = mla_plan(args, mla_params(args, out, at::Tensor()));
  return plan.error.empty() ? kernels::describe_plan(plan) : plan.error;
}

}  // namespace

TORCH_LIBRARY_IMPL(astr, CUDA, m) {
  m.impl("cuda_mla_attention", &cuda_mla_attention);
  m.impl("cuda_mla_plan", &cuda_mla_plan);
}

}  // namespace astr::backends
