// The torch_native backend, astrai's reference: composite ATen on the call's device. Plain calls
// run at::scaled_dot_product_attention; calls with a variant (window, softcap, sinks, top-k
// indices, a tree mask) or asking for the log-sum-exp write the scores out (attend_with_variants),
// from the definitions in csrc/kernels/paged_attention/params.h (top-k: csrc/README.md).
// Everything is expressed with tensor ops: no host synchronisation, so a decode step stays
// capturable; and everything stays differentiable (CompositeImplicitAutograd), gradients through
// sinks included.
//
// Batch-invariant mode (support/kernel_settings.h) runs paged calls through
// attend_batch_invariant, whose sums have a fixed order whatever the batch.
#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "backends/backends.h"
#include "support/kernel_settings.h"

namespace astr {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool has_variant(const AttentionArgs& a) {
  return a.window_left >= 0 || a.softcap.has_value() || a.sinks.has_value() || a.return_lse ||
         a.topk_indices.has_value();
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The keys each query row lists in topk_indices, [rows, columns] bool (a position listed twice
// counts once; -1 lists nothing), and the rows that list a position outside their sequence,
// [rows] bool: the caller writes those rows as NaN (the values are checked only where reading
// them is free, so an unchecked bad entry must neither be read nor give finite numbers).
//   indices [rows, topk] int32; kv_len [rows] or a scalar (long): each row's key positions are
//   [0, kv_len); columns >= every kv_len.
std::tuple<at::Tensor, at::Tensor> listed_keys(const at::Tensor& indices, const at::Tensor& kv_len,
                                               int64_t columns) {
  const at::Tensor index = indices.to(at::kLong);
  const at::Tensor bound = kv_len.dim() == 0 ? kv_len : kv_len.unsqueeze(-1);
  const at::Tensor inside = index.ge(0).logical_and(index.lt(bound));
  const at::Tensor bad = index.ne(-1).logical_and(inside.logical_not()).any(-1);
  // Unused and bad entries land in one extra column, cut off after the scatter.
  const at::Tensor target = at::where(inside, index, at::full({}, columns, index.options()));
  at::Tensor listed = at::zeros({indices.size(0), columns + 1}, index.options().dtype(at::kBool));
  listed.scatter_(1, target, true);
  return {listed.slice(1, 0, columns), bad};
}

// Which keys each query sees, [Lq, Lk] bool: causal (query i at absolute position
// positions[i] sees keys j <= positions[i]) and the window (keys j >= positions[i] - window).
at::Tensor position_visibility(const at::Tensor& q_positions, int64_t kv_len, bool is_causal,
                               int64_t window_left) {
  const at::Tensor kv = at::arange(kv_len, q_positions.options()).unsqueeze(0);
  const at::Tensor qp = q_positions.unsqueeze(-1);
  at::Tensor visible =
      at::ones({q_positions.size(-1), kv_len}, q_positions.options().dtype(at::kBool));
  if (is_causal) visible = visible.logical_and(kv <= qp);
  if (window_left >= 0) visible = visible.logical_and(kv >= qp - window_left);
  return visible;
}

// softmax(scale * q k^T (softcapped) + bias, masked to `visible`, with sink logits) v, and the
// log-sum-exp of each row, in float32 (float64 for float64 inputs).
//   q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]; visible broadcastable to
//   [B, Hq, Lq, Lk] (bool) or undefined; bias likewise (additive) or undefined; sinks [Hq].
// Returns out [B, Hq, Lq, Dv] in q's dtype and lse [B, Hq, Lq] float32. A row that sees no key
// (and has no sink) gives out 0 and lse -inf; the formulation keeps gradients finite there.
std::tuple<at::Tensor, at::Tensor> attend_with_variants(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v,
                                                        const at::Tensor& visible,
                                                        const at::Tensor& bias, double scale,
                                                        std::optional<double> softcap,
                                                        const std::optional<at::Tensor>& sinks) {
  const at::ScalarType compute = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t batch = q.size(0), q_heads = q.size(1), q_len = q.size(2);
  const int64_t kv_heads = k.size(1), kv_len = k.size(2), group = q_heads / kv_heads;
  // GQA without repeating kv heads: q head h = kv head h / G, member h % G.
  const at::Tensor qg = q.to(compute).reshape({batch, kv_heads, group * q_len, q.size(3)});
  at::Tensor scores = at::matmul(qg, k.to(compute).transpose(-1, -2)) * scale;
  scores = scores.view({batch, q_heads, q_len, kv_len});
  if (softcap) scores = at::tanh(scores / *softcap) * *softcap;
  if (bias.defined()) scores = scores + bias.to(compute);
  if (visible.defined()) scores = scores.masked_fill(visible.logical_not(), -kInf);

  // Stable softmax with the sink as one more logit: m = max over keys and sink (a constant for
  // autograd), sum = sum exp(s - m) + exp(sink - m). Over no keys at all (an empty split) the
  // max is -inf: out 0, lse -inf or the sink's logit.
  at::Tensor top = kv_len > 0 ? std::get<0>(scores.max(-1, /*keepdim=*/true))
                              : at::full({batch, q_heads, q_len, 1}, -kInf, scores.options());
  at::Tensor sink_logits;
  if (sinks) {
    sink_logits = sinks->to(compute).view({1, q_heads, 1, 1});
    top = at::maximum(top, sink_logits.expand_as(top));
  }
  top = at::where(at::isinf(top), at::zeros_like(top), top).detach();
  const at::Tensor weights = at::exp(scores - top);
  at::Tensor sum = weights.sum(-1, /*keepdim=*/true);
  if (sinks) sum = sum + at::exp(sink_logits - top);
  const at::Tensor seen = sum > 0;
  const at::Tensor safe_sum = at::where(seen, sum, at::ones_like(sum));
  const at::Tensor probs = (weights / safe_sum).view({batch, kv_heads, group * q_len, kv_len});
  at::Tensor out = at::matmul(probs, v.to(compute)).view({batch, q_heads, q_len, v.size(3)});
  at::Tensor lse = at::where(seen, at::log(safe_sum) + top, at::full_like(sum, -kInf));
  return {out.to(q.scalar_type()), lse.squeeze(-1).to(at::kFloat)};
}

// x with zeros appended along dim (>= 0) up to a length of `length`.
at::Tensor zero_padded(const at::Tensor& x, int64_t dim, int64_t length) {
  if (x.size(dim) == length) return x;
  std::vector<int64_t> shape = x.sizes().vec();
  shape[dim] = length - x.size(dim);
  return at::cat({x, at::zeros(shape, x.options())}, dim);
}

// The sum over dim (>= 0) as a halving tree of elementwise adds over its length rounded up to a
// power of two (zeros appended).
at::Tensor halving_sum(at::Tensor x, int64_t dim) {
  int64_t width = 1;
  while (width < x.size(dim)) width *= 2;
  x = zero_padded(x, dim, width);
  while (width > 1) {
    width /= 2;
    x = x.narrow(dim, 0, width) + x.narrow(dim, width, width);
  }
  return x.squeeze(dim);
}

// The sum over dim in an order fixed by the positions alone: chunks of kSumChunk positions
// (zeros appended to the last), each summed by a halving tree, then the chunks' sums by another.
// Each element's sum is the same additions whatever the tensor's other sizes, and whatever zeros
// follow its values (a longer length only adds chunks, and tree levels, that add zero), where a
// library's reduction or matmul blocks, splits or vectorises by the sizes of the whole tensor.
// (x + 0 is x but for -0, which becomes +0: the caller adds +0 to its result so that both read
// +0.)
constexpr int64_t kSumChunk = 64;
at::Tensor fixed_order_sum(at::Tensor x, int64_t dim) {
  if (dim < 0) dim += x.dim();
  const int64_t chunks = std::max<int64_t>(1, (x.size(dim) + kSumChunk - 1) / kSumChunk);
  x = zero_padded(x, dim, chunks * kSumChunk).unflatten(dim, {chunks, kSumChunk});
  return halving_sum(halving_sum(x, dim + 1), dim);
}

// attend_with_variants' arithmetic with every sum in an order fixed by the positions alone, so
// that a row's result is the same bits whatever the batch around it: the batch size, the
// sequence's place in it, the block table's width (zeros past the sequence's length) and the
// query rows padding the shorter sequences (max_query_len). Matmuls, SDPA and sum reductions
// pick their blocking and vectorisation by the whole tensor's sizes (on the CPU a matmul's rows
// differ with their count), so they are not used: q . k is added up over d = 0, 1, ..., D - 1,
// and the sums over kv positions are fixed_order_sum's. Everything else is elementwise or a max,
// whose results do not depend on the order. Elementwise work where the plain path multiplies
// matrices: on a 2-core CPU 3.5x the plain path's time for a decode (B = 16, L = 1024, D = 128),
// 6x for a verify of 8 drafts, 24x for a prefill of 128 tokens.
//   q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], visible [B, 1, Lq, Lk], bias as
//   attend_with_variants'. Returns out [B, Hq, Lq, Dv] in q's dtype and lse [B, Hq, Lq] float32.
std::tuple<at::Tensor, at::Tensor> attend_batch_invariant(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const at::Tensor& visible,
                                                          const at::Tensor& bias, double scale,
                                                          std::optional<double> softcap,
                                                          const std::optional<at::Tensor>& sinks) {
  const at::ScalarType compute = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t batch = q.size(0), q_heads = q.size(1), q_len = q.size(2);
  const int64_t kv_heads = k.size(1), kv_len = k.size(2), group = q_heads / kv_heads;
  const int64_t rows = group * q_len;
  // d first, contiguous: [D, B, Hkv, rows, 1] and [D, B, Hkv, 1, Lk], read one d at a time.
  const at::Tensor qd = q.to(compute)
                            .reshape({batch, kv_heads, rows, q.size(3)})
                            .permute({3, 0, 1, 2})
                            .contiguous()
                            .unsqueeze(-1);
  const at::Tensor kd = k.to(compute).permute({3, 0, 1, 2}).contiguous().unsqueeze(-2);
  at::Tensor dot = qd[0] * kd[0];
  for (int64_t d = 1; d < q.size(3); ++d) dot = dot + qd[d] * kd[d];
  at::Tensor scores = (dot * scale).view({batch, q_heads, q_len, kv_len});
  if (softcap) scores = at::tanh(scores / *softcap) * *softcap;
  if (bias.defined()) scores = scores + bias.to(compute);
  scores = scores.masked_fill(visible.logical_not(), -kInf);

  at::Tensor top = kv_len > 0 ? std::get<0>(scores.max(-1, /*keepdim=*/true))
                              : at::full({batch, q_heads, q_len, 1}, -kInf, scores.options());
  at::Tensor sink_logits;
  if (sinks) {
    sink_logits = sinks->to(compute).view({1, q_heads, 1, 1});
    top = at::maximum(top, sink_logits.expand_as(top));
  }
  top = at::where(at::isinf(top), at::zeros_like(top), top).detach();
  const at::Tensor weights = at::exp(scores - top);
  at::Tensor sum = fixed_order_sum(weights, -1).unsqueeze(-1);
  if (sinks) sum = sum + at::exp(sink_logits - top);
  const at::Tensor seen = sum > 0;
  const at::Tensor safe_sum = at::where(seen, sum, at::ones_like(sum));

  // O = sum_j w_j v_j, d by d (d first: [Dv, B, Hkv, 1, Lk']) in pieces of a few million
  // products, over the positions padded once to whole chunks.
  const int64_t padded = std::max<int64_t>(1, (kv_len + kSumChunk - 1) / kSumChunk) * kSumChunk;
  const at::Tensor w = zero_padded(weights.view({batch, kv_heads, rows, kv_len}), 3, padded);
  const at::Tensor vd =
      zero_padded(v.to(compute).permute({3, 0, 1, 2}).contiguous(), 3, padded).unsqueeze(3);
  const int64_t per_d = std::max<int64_t>(1, batch * kv_heads * rows * padded);
  const int64_t piece = std::clamp<int64_t>((int64_t{1} << 22) / per_d, 1, v.size(3));
  std::vector<at::Tensor> columns;
  for (int64_t d = 0; d < v.size(3); d += piece) {
    const int64_t n = std::min(piece, v.size(3) - d);
    columns.push_back(fixed_order_sum(vd.narrow(0, d, n) * w, -1));  // [n, B, Hkv, rows]
  }
  at::Tensor out =
      at::cat(columns, 0).permute({1, 2, 3, 0}).reshape({batch, q_heads, q_len, v.size(3)});
  out = out / safe_sum + 0.0;  // + 0: -0 (all products +-0) reads +0 whatever the width
  const at::Tensor lse = at::where(seen, at::log(safe_sum) + top, at::full_like(sum, -kInf));
  return {out.to(q.scalar_type()), lse.squeeze(-1).to(at::kFloat)};
}

}  // namespace

AttentionResult torch_native_dense(const AttentionArgs& a) {
  const at::Tensor& q = a.q;
  const at::Tensor& k = *a.k;
  const at::Tensor& v = *a.v;
  if (!has_variant(a)) {
    std::optional<at::Tensor> mask = a.attn_mask;
    bool is_causal = a.is_causal;
    if (mask && is_causal) {
      // SDPA takes one or the other: fold the causal edge (top-left aligned) into the mask.
      const at::Tensor causal = position_visibility(
          at::arange(q.size(1), q.options().dtype(at::kLong)), k.size(1), true, -1);
      mask = mask->scalar_type() == at::kBool ? at::logical_and(*mask, causal)
                                              : mask->masked_fill(causal.logical_not(), -kInf);
      is_causal = false;
    }
    at::Tensor out = at::scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, /*dropout_p=*/0.0, is_causal,
        a.resolved_scale(), /*enable_gqa=*/q.size(2) != k.size(2));
    return {out.transpose(1, 2).contiguous(), at::Tensor()};
  }
  // Positions are top-left aligned, as SDPA's is_causal: query i at position i.
  at::Tensor visible;
  if (a.is_causal || a.window_left >= 0) {
    visible = position_visibility(at::arange(q.size(1), q.options().dtype(at::kLong)), k.size(1),
                                  a.is_causal, a.window_left);
  }
  at::Tensor bad_rows;  // [B, Lq]: rows whose topk_indices leave the sequence
  if (a.topk_indices) {
    const int64_t batch = q.size(0), q_len = q.size(1), kv_len = k.size(1);
    const at::Tensor indices = a.topk_indices->reshape({batch * q_len, a.topk_indices->size(-1)});
    auto [listed, bad] =
        listed_keys(indices, at::scalar_tensor(kv_len, q.options().dtype(at::kLong)), kv_len);
    listed = listed.view({batch, 1, q_len, kv_len});
    visible = visible.defined() ? visible.logical_and(listed) : listed;
    bad_rows = bad.view({batch, q_len});
  }
  at::Tensor bias;
  if (a.attn_mask) {
    if (a.attn_mask->scalar_type() == at::kBool) {
      visible = visible.defined() ? visible.logical_and(*a.attn_mask) : *a.attn_mask;
    } else {
      bias = *a.attn_mask;
    }
  }
  auto [out, lse] = attend_with_variants(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         visible, bias, a.resolved_scale(), a.softcap, a.sinks);
  out = out.transpose(1, 2);  // [B, Lq, Hq, Dv]
  lse = lse.transpose(1, 2);  // [B, Lq, Hq]
  if (bad_rows.defined()) {
    out = at::where(bad_rows.view({q.size(0), q.size(1), 1, 1}), at::full({}, kNaN, out.options()),
                    out);
    lse = at::where(bad_rows.unsqueeze(-1), at::full({}, kNaN, lse.options()), lse);
  }
  return {out.contiguous(), a.return_lse ? lse.contiguous() : at::Tensor()};
}

at::Tensor sequences_in_range(const at::Tensor& table, const at::Tensor& seq_len,
                              const at::Tensor& q_len, int64_t page_size, int64_t num_pages,
                              int64_t max_q, const std::optional<at::Tensor>& query_start_loc,
                              int64_t tokens) {
  const int64_t batch = table.size(0), width = table.size(1);
  const at::Tensor pages_used = (seq_len + page_size - 1).div(page_size, "floor");
  const at::Tensor used =
      at::arange(width, table.options()).view({1, width}) < pages_used.view({-1, 1});
  const at::Tensor bad_page = used.logical_and(table.lt(0).logical_or(table.ge(num_pages)));
  at::Tensor valid = bad_page.any(1).logical_not();
  valid = valid.logical_and(seq_len.le(width * page_size)).logical_and(seq_len.ge(q_len));
  valid = valid.logical_and(seq_len.ge(0));
  valid = valid.logical_and(q_len.ge(0)).logical_and(q_len.le(max_q));
  if (query_start_loc) {
    // query_start_loc places every token of q only if it runs from 0 to T without decreasing;
    // otherwise tokens belong to no sequence or to two, and no row of the batch can be trusted.
    // Checked here too because compiled code runs no host checks (describe_call.cpp skips values
    // it cannot read while tracing).
    const at::Tensor starts = query_start_loc->to(at::kLong);
    const at::Tensor placed = starts.select(0, 0)
                                  .eq(0)
                                  .logical_and(starts.select(0, batch).eq(tokens))
                                  .logical_and(q_len.ge(0).all());
    valid = valid.logical_and(placed);
  }
  return valid;
}

AttentionResult torch_native_paged(const AttentionArgs& a) {
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

  // Which sequence each query token belongs to, and its index among that sequence's new tokens.
  const at::Tensor seq_len = a.seq_lens->to(at::kLong);  // [B]
  at::Tensor q_len, seq_of_token, pos_of_token;
  if (a.decode()) {
    // A decode slot of length 0 is padding: no new token in the cache, zeros out.
    q_len = seq_len.clamp(0, 1);
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

  // K/V of every sequence, padded to the table's capacity: [B, capacity, Hkv, D]. Only the slots
  // a sequence owns (positions below its length) may contribute: the others (columns past its
  // pages, which may point anywhere, and the stale tail of its last page) are zeroed, since a
  // masked score still multiplies its value (0 * NaN is NaN).
  const at::Tensor table = a.block_table->to(at::kLong);
  const at::Tensor pages = table.clamp(0, num_pages - 1).reshape({-1});
  const at::Tensor kv_pos = at::arange(capacity, long_opts);
  const at::Tensor owned =
      (kv_pos.view({1, capacity}) < seq_len.view({batch, 1})).view({batch, capacity, 1, 1});
  // An FP8 cache is read as stored.float() * scale[kv head] (gathered as bytes), and the
  // attention then runs in float32: the reference for the kernels, which read the same bytes.
  const bool fp8 = a.k_scale.has_value();
  auto gather = [&](const at::Tensor& pool, const std::optional<at::Tensor>& scale) {
    at::Tensor rows = fp8 ? pool.view(at::kByte).index_select(0, pages).view(pool.scalar_type())
                          : pool.index_select(0, pages);
    rows = rows.view({batch, capacity, kv_heads, -1});
    if (fp8) rows = rows.to(at::kFloat) * scale->view({1, 1, kv_heads, 1});
    return at::where(owned, rows, at::zeros({}, rows.options()));
  };
  const at::Tensor keys = gather(k_cache, a.k_scale);
  const at::Tensor values = gather(v_cache, a.v_scale);

  // Queries padded per sequence: [B, max_q, Hq, D] (float32 with an FP8 cache).
  const at::Tensor q_in = fp8 ? q.to(at::kFloat) : q;
  at::Tensor queries = at::zeros({batch, max_q, q_heads, q.size(2)}, q_in.options());
  queries.index_put_({seq_of_token, pos_of_token}, q_in);

  // Visibility [B, max_q, capacity]: inside the sequence, causal from the prefix's end (or the
  // tree mask's), and the window. New token i sits at position seq_len - q_len + i.
  const at::Tensor kv = kv_pos.view({1, 1, capacity});
  const at::Tensor first_new = (seq_len - q_len).view({batch, 1, 1});
  const at::Tensor q_pos = at::arange(max_q, long_opts).view({1, max_q, 1}) + first_new;
  at::Tensor visible = kv < seq_len.view({batch, 1, 1});
  if (a.tree_mask) {
    // Row t of the tree mask, per sequence [B, max_q, max_q]: column j is the sequence's new token
    // j, at position first_new + j; the positions before the new tokens stay visible.
    at::Tensor tree = at::zeros({batch, max_q, max_q}, a.tree_mask->options());
    tree.index_put_({seq_of_token, pos_of_token}, a.tree_mask->slice(1, 0, max_q));
    const at::Tensor column = kv - first_new;  // [B, 1, capacity]
    const at::Tensor named = tree.gather(2, column.clamp(0, max_q - 1).expand({batch, max_q, -1}));
    visible = visible.logical_and(column.lt(0).logical_or(named.logical_and(column.lt(max_q))));
  } else if (a.is_causal) {
    visible = visible.logical_and(kv <= q_pos);
  }
  if (a.window_left >= 0) visible = visible.logical_and(kv >= q_pos - a.window_left);
  visible = visible.expand({batch, max_q, capacity});

  at::Tensor bad_tokens;  // [T]: tokens whose topk_indices leave their sequence
  if (a.topk_indices) {
    // Positions within the token's sequence; a decode padding slot (length 0) is zeros anyway.
    const at::Tensor length = seq_len.index_select(0, seq_of_token);
    auto [listed, bad] = listed_keys(*a.topk_indices, length, capacity);
    at::Tensor padded = at::zeros({batch, max_q, capacity}, listed.options());
    padded.index_put_({seq_of_token, pos_of_token}, listed);
    visible = visible.logical_and(padded);
    bad_tokens = a.decode() ? bad.logical_and(length.gt(0)) : bad;
  }

  at::Tensor bias;
  if (a.attn_mask) {
    // The user's [T, K] mask, cut or padded to [T, capacity]; positions >= K are masked.
    at::Tensor mask = *a.attn_mask;
    const int64_t columns = mask.size(1);
    const bool boolean = mask.scalar_type() == at::kBool;
    if (columns >= capacity) {
      mask = mask.slice(1, 0, capacity);
    } else {
      at::Tensor pad = boolean ? at::zeros({tokens, capacity - columns}, mask.options())
                               : at::full({tokens, capacity - columns}, -kInf, mask.options());
      mask = at::cat({mask, pad}, 1);
    }
    at::Tensor padded = boolean ? at::zeros({batch, max_q, capacity}, mask.options())
                                : at::full({batch, max_q, capacity}, -kInf, mask.options());
    padded.index_put_({seq_of_token, pos_of_token}, mask);
    if (boolean) {
      visible = visible.logical_and(padded);
    } else {
      visible = visible.logical_and(padded != -kInf);
      bias = padded.masked_fill(visible.logical_not(), -kInf).unsqueeze(1);
    }
  }

  at::Tensor out, lse;
  if (batch_invariant_enabled()) {
    std::tie(out, lse) = attend_batch_invariant(queries.transpose(1, 2), keys.transpose(1, 2),
                                                values.transpose(1, 2), visible.unsqueeze(1), bias,
                                                a.resolved_scale(), a.softcap, a.sinks);
  } else if (!has_variant(a)) {
    const at::Tensor sdpa_mask = bias.defined() ? bias : visible.unsqueeze(1);
    out = at::scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2), sdpa_mask, /*dropout_p=*/0.0,
                                           /*is_causal=*/false, a.resolved_scale(),
                                           /*enable_gqa=*/q_heads != kv_heads);
    // A row that sees no key returns zeros (SDPA would give NaN).
    const at::Tensor row_sees_keys = visible.any(-1).view({batch, 1, max_q, 1});
    out = at::where(row_sees_keys, out, at::zeros({}, out.options()));
  } else {
    std::tie(out, lse) =
        attend_with_variants(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                             visible.unsqueeze(1), bias, a.resolved_scale(), a.softcap, a.sinks);
  }
  out = out.transpose(1, 2);  // [B, max_q, Hq, Dv]

  // Poison sequences whose metadata is out of range (checked with tensor ops: no host sync).
  const at::Tensor valid =
      sequences_in_range(table, seq_len, q_len, page_size, num_pages, max_q,
                         a.decode() ? std::nullopt : a.query_start_loc, tokens);
  out = at::where(valid.view({batch, 1, 1, 1}), out, at::full({}, kNaN, out.options()));
  out = out.index({seq_of_token, pos_of_token}).to(q.scalar_type());  // [T, Hq, Dv]
  if (bad_tokens.defined()) {
    out = at::where(bad_tokens.view({tokens, 1, 1}), at::full({}, kNaN, out.options()), out);
  }
  if (!a.return_lse) return {out, at::Tensor()};
  lse = at::where(valid.view({batch, 1, 1}), lse, at::full({}, kNaN, lse.options()));
  lse = lse.transpose(1, 2).index({seq_of_token, pos_of_token});  // [T, Hq]
  if (bad_tokens.defined()) {
    lse = at::where(bad_tokens.view({tokens, 1}), at::full({}, kNaN, lse.options()), lse);
  }
  return {out, lse};
}

}  // namespace astr
