// The torch_native backend: at::scaled_dot_product_attention over BLHD inputs, and over K/V
// gathered through the page table for paged calls. Everything is expressed with tensor ops on the
// call's device: no host synchronisation, so a decode step stays capturable.
#include <ATen/ATen.h>

#include <limits>

#include "backends.h"

namespace astr {

namespace {

// A causal mask aligned top-left (query i sees keys j <= i), as SDPA's is_causal.
at::Tensor top_left_causal(int64_t q_len, int64_t kv_len, const at::Device& device) {
  return at::ones({q_len, kv_len}, at::TensorOptions().dtype(at::kBool).device(device)).tril();
}

}  // namespace

at::Tensor torch_native_dense(const AttentionArgs& a) {
  const at::Tensor& q = a.q;
  const at::Tensor& k = *a.k;
  const at::Tensor& v = *a.v;
  std::optional<at::Tensor> mask = a.attn_mask;
  bool is_causal = a.is_causal;
  if (mask && is_causal) {
    // SDPA takes one or the other: fold the causal edge into the mask.
    at::Tensor causal = top_left_causal(q.size(1), k.size(1), q.device());
    mask = mask->scalar_type() == at::kBool
               ? at::logical_and(*mask, causal)
               : mask->masked_fill(causal.logical_not(), -std::numeric_limits<double>::infinity());
    is_causal = false;
  }
  at::Tensor out = at::scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, /*dropout_p=*/0.0, is_causal,
      a.resolved_scale(), /*enable_gqa=*/q.size(2) != k.size(2));
  return out.transpose(1, 2).contiguous();
}

at::Tensor torch_native_paged(const AttentionArgs& a) {
  const at::Tensor& q = a.q;  // [T,Hq,D]
  const at::Tensor& k_cache = *a.k_cache;
  const at::Tensor& v_cache = *a.v_cache;
  const int64_t tokens = q.size(0), q_heads = q.size(1);
  const int64_t num_pages = k_cache.size(0), page_size = k_cache.size(1);
  const int64_t kv_heads = k_cache.size(2);
  const int64_t batch = a.seq_lens->size(0), width = a.block_table->size(1);
  const int64_t capacity = width * page_size;  // the most kv positions any sequence can have
  const int64_t max_q = a.decode() ? 1 : a.max_query_len;
  const auto long_opts = q.options().dtype(at::kLong);
  const double inf = std::numeric_limits<double>::infinity();

  // Which sequence each query token belongs to, and its index among that sequence's new tokens.
  const at::Tensor seq_len = a.seq_lens->to(at::kLong);  // [B]
  at::Tensor q_len, seq_of_token, pos_of_token;
  if (a.decode()) {
    q_len = at::ones({batch}, long_opts);
    seq_of_token = at::arange(tokens, long_opts);
    pos_of_token = at::zeros({tokens}, long_opts);
  } else {
    const at::Tensor starts = a.query_start_loc->to(at::kLong);  // [B+1]
    q_len = starts.slice(0, 1) - starts.slice(0, 0, batch);
    const at::Tensor token = at::arange(tokens, long_opts);
    // Searching the whole of `starts` (not a slice of it): inductor cannot lower searchsorted
    // over a sliced boundary tensor on CUDA (torch 2.11: NotImplementedError: SliceView).
    seq_of_token = (at::searchsorted(starts, token, /*out_int32=*/false, /*right=*/true) - 1)
                       .clamp(0, batch - 1);
    pos_of_token = (token - starts.index_select(0, seq_of_token)).clamp(0, max_q - 1);
  }

  // K/V of every sequence, padded to the table's capacity: [B, capacity, Hkv, D].
  const at::Tensor table = a.block_table->to(at::kLong);
  const at::Tensor pages = table.clamp(0, num_pages - 1).reshape({-1});
  const at::Tensor keys = k_cache.index_select(0, pages).view({batch, capacity, kv_heads, -1});
  const at::Tensor values = v_cache.index_select(0, pages).view({batch, capacity, kv_heads, -1});

  // Queries padded per sequence: [B, max_q, Hq, D].
  at::Tensor queries = at::zeros({batch, max_q, q_heads, q.size(2)}, q.options());
  queries.index_put_({seq_of_token, pos_of_token}, q);

  // Visibility [B, max_q, capacity]: inside the sequence, and causal from the prefix's end.
  const at::Tensor kv_pos = at::arange(capacity, long_opts).view({1, 1, capacity});
  const at::Tensor prefix = (seq_len - q_len).view({batch, 1, 1});
  const at::Tensor q_pos = at::arange(max_q, long_opts).view({1, max_q, 1}) + prefix;
  at::Tensor visible = kv_pos < seq_len.view({batch, 1, 1});
  if (a.is_causal) visible = visible.logical_and(kv_pos <= q_pos);
  visible = visible.expand({batch, max_q, capacity});

  std::optional<at::Tensor> bias;
  if (a.attn_mask) {
    // The user's [T, K] mask, cut or padded to [T, capacity]; positions >= K are masked.
    at::Tensor mask = *a.attn_mask;
    const int64_t columns = mask.size(1);
    const bool boolean = mask.scalar_type() == at::kBool;
    if (columns >= capacity) {
      mask = mask.slice(1, 0, capacity);
    } else {
      at::Tensor pad = boolean ? at::zeros({tokens, capacity - columns}, mask.options())
                               : at::full({tokens, capacity - columns}, -inf, mask.options());
      mask = at::cat({mask, pad}, 1);
    }
    at::Tensor padded = boolean ? at::zeros({batch, max_q, capacity}, mask.options())
                                : at::full({batch, max_q, capacity}, -inf, mask.options());
    padded.index_put_({seq_of_token, pos_of_token}, mask);
    if (boolean) {
      visible = visible.logical_and(padded);
    } else {
      visible = visible.logical_and(padded != -inf);
      bias = padded.masked_fill(visible.logical_not(), -inf).unsqueeze(1);
    }
  }
  const at::Tensor sdpa_mask = bias ? *bias : visible.unsqueeze(1);  // [B, 1, max_q, capacity]

  at::Tensor out = at::scaled_dot_product_attention(
      queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), sdpa_mask,
      /*dropout_p=*/0.0, /*is_causal=*/false, a.resolved_scale(),
      /*enable_gqa=*/q_heads != kv_heads);
  out = out.transpose(1, 2);  // [B, max_q, Hq, Dv]

  // A row that sees no key returns zeros (SDPA would give NaN).
  const at::Tensor row_sees_keys = visible.any(-1).view({batch, max_q, 1, 1});
  out = at::where(row_sees_keys, out, at::zeros({}, out.options()));

  // Poison sequences whose metadata is out of range (checked with tensor ops: no host sync).
  const at::Tensor pages_used = (seq_len + page_size - 1).div(page_size, "floor");
  const at::Tensor used = at::arange(width, long_opts).view({1, width}) < pages_used.view({-1, 1});
  const at::Tensor bad_page = used.logical_and(table.lt(0).logical_or(table.ge(num_pages)));
  at::Tensor valid = bad_page.any(1).logical_not();
  valid = valid.logical_and(seq_len.le(capacity)).logical_and(seq_len.ge(q_len));
  valid = valid.logical_and(q_len.ge(0)).logical_and(q_len.le(max_q));
  const double nan = std::numeric_limits<double>::quiet_NaN();
  out = at::where(valid.view({batch, 1, 1, 1}), out, at::full({}, nan, out.options()));

  return out.index({seq_of_token, pos_of_token});  // [T, Hq, Dv]
}

}  // namespace astr
