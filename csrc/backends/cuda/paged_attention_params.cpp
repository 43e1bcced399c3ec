#include "backends/cuda/paged_attention_params.h"

#include <algorithm>
#include <cstdint>

#include "support/torch_scalar_type.h"

namespace astr::backends {

namespace {

int log2_of_power_of_two(int64_t value) {
  int log2 = 0;
  while ((int64_t{1} << log2) < value) ++log2;
  return log2;
}

int clamp_to_int(int64_t value) { return static_cast<int>(std::min<int64_t>(value, INT32_MAX)); }

}  // namespace

kernels::PagedAttentionParams paged_attention_params(const AttentionArgs& a,
                                                     const PagedCallShape& shape,
                                                     const at::Tensor& out, const at::Tensor& lse) {
  const at::Tensor& q = a.q;
  const at::Tensor& k_cache = *a.k_cache;
  const at::Tensor& v_cache = *a.v_cache;
  kernels::PagedAttentionParams p{};
  p.q = q.data_ptr();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.q_dtype = scalar_type_of(q.scalar_type());
  point_at_pools(p, k_cache, v_cache);
  p.kv_dtype = scalar_type_of(k_cache.scalar_type());
  p.num_pages = static_cast<int>(shape.num_pages);
  p.k_scale = shape.fp8 ? a.k_scale->data_ptr<float>() : nullptr;
  p.v_scale = shape.fp8 ? a.v_scale->data_ptr<float>() : nullptr;
  p.block_table = a.block_table->data_ptr<int32_t>();
  p.block_table_stride = a.block_table->stride(0);
  p.block_table_width = clamp_to_int(shape.width);
  p.seq_lens = a.seq_lens->data_ptr<int32_t>();
  if (a.attn_mask) {
    p.attn_mask = a.attn_mask->data_ptr<bool>();
    p.mask_stride_token = a.attn_mask->stride(0);
    p.mask_kv_len = clamp_to_int(a.attn_mask->size(1));
  }
  if (a.tree_mask) {
    p.tree_mask = a.tree_mask->data_ptr<bool>();
    p.tree_mask_stride_token = a.tree_mask->stride(0);
    p.tree_mask_width = clamp_to_int(a.tree_mask->size(1));
  }
  if (a.topk_indices) {
    p.topk_indices = a.topk_indices->data_ptr<int32_t>();
    p.topk_stride_token = a.topk_indices->stride(0);
    p.topk = clamp_to_int(a.topk_indices->size(1));
  }
  p.window_left = static_cast<int>(a.window_left);
  p.softcap = static_cast<float>(a.softcap_value());
  p.sinks = a.sinks ? a.sinks->data_ptr<float>() : nullptr;
  p.lse = lse.defined() ? lse.data_ptr<float>() : nullptr;
  p.lse_stride_token = shape.num_q_heads;
  p.out = out.data_ptr();
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.num_seqs = static_cast<int>(shape.num_seqs);
  p.num_tokens = static_cast<int>(shape.num_tokens);
  p.num_q_heads = static_cast<int>(shape.num_q_heads);
  p.num_kv_heads = static_cast<int>(shape.num_kv_heads);
  p.head_dim = static_cast<int>(shape.head_dim);
  p.head_dim_v = static_cast<int>(shape.head_dim_v);
  p.log2_page_size = log2_of_power_of_two(shape.page_size);
  p.is_causal = a.is_causal;
  p.scale = static_cast<float>(a.resolved_scale());
  return p;
}

kernels::DecodeShape decode_shape(const PagedCallShape& shape, const AttentionArgs& args) {
  kernels::DecodeShape decode;
  decode.num_seqs = static_cast<int>(shape.num_seqs);
  decode.num_q_heads = static_cast<int>(shape.num_q_heads);
  decode.num_kv_heads = static_cast<int>(shape.num_kv_heads);
  decode.head_dim = static_cast<int>(shape.head_dim);
  decode.head_dim_v = static_cast<int>(shape.head_dim_v);
  decode.block_table_positions = shape.width * shape.page_size;
  decode.window_left = static_cast<int>(args.window_left);
  decode.kv_bytes = shape.fp8 ? 1 : 2;
  return decode;
}

kernels::TopkShape topk_shape(const PagedCallShape& shape, const AttentionArgs& args) {
  kernels::TopkShape topk;
  topk.num_tokens = shape.num_tokens;
  topk.num_q_heads = static_cast<int>(shape.num_q_heads);
  topk.num_kv_heads = static_cast<int>(shape.num_kv_heads);
  topk.head_dim = static_cast<int>(shape.head_dim);
  topk.head_dim_v = static_cast<int>(shape.head_dim_v);
  topk.topk = args.topk_indices ? args.topk_indices->size(1) : 0;
  topk.kv_bytes = shape.fp8 ? 1 : 2;
  return topk;
}

kernels::PrefillKvFootprint prefill_kv_footprint(const PagedCallShape& shape,
                                                 int64_t q_element_bytes) {
  kernels::PrefillKvFootprint footprint;
  footprint.pairs = shape.num_seqs * shape.num_kv_heads;
  footprint.bytes_per_pair =
      shape.width * shape.page_size * (shape.head_dim + shape.head_dim_v) * q_element_bytes;
  return footprint;
}

}  // namespace astr::backends
