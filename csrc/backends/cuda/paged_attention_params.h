// A checked paged call as the kernels' parameter struct and the plans' shapes.
#pragma once

#include <ATen/ATen.h>

#include "backends/cuda/paged_attention_checks.h"
#include "kernels/paged_attention/params.h"
#include "kernels/paged_attention/plan.h"

namespace astr::backends {

// Raw pointers and strides of q, the pools, the metadata, the variants' tensors, out [T,Hq,D] and
// lse ([T,Hq] float32, or undefined when the call returns none).
kernels::PagedAttentionParams paged_attention_params(const AttentionArgs& args,
                                                     const PagedCallShape& shape,
                                                     const at::Tensor& out, const at::Tensor& lse);

// Points a parameter struct's pools (k_cache, v_cache and their page, slot and head strides: the
// paged kernels' and the dequantizing pass's fields) at two [P, S, Hkv, D] pools.
template <typename Params>
void point_at_pools(Params& params, const at::Tensor& k_pool, const at::Tensor& v_pool) {
  params.k_cache = k_pool.data_ptr();
  params.v_cache = v_pool.data_ptr();
  params.k_stride_page = k_pool.stride(0);
  params.k_stride_slot = k_pool.stride(1);
  params.k_stride_head = k_pool.stride(2);
  params.v_stride_page = v_pool.stride(0);
  params.v_stride_slot = v_pool.stride(1);
  params.v_stride_head = v_pool.stride(2);
}

kernels::DecodeShape decode_shape(const PagedCallShape& shape, const AttentionArgs& args);

// A top-k call's shape (topk_indices given; its mode decides nothing), batch_invariant unset.
kernels::TopkShape topk_shape(const PagedCallShape& shape, const AttentionArgs& args);

// The K/V one (sequence, kv head) pair may read, for the prefill's block order; the element the
// kernel reads is q's dtype (an FP8 cache is dequantized to it first, or read at 2 bytes' cost).
kernels::PrefillKvFootprint prefill_kv_footprint(const PagedCallShape& shape,
                                                 int64_t q_element_bytes);

}  // namespace astr::backends
