// The torch_native backend of astr::mla_attention, the reference: composite ATen on the call's
// device, from the definition (csrc/README.md, "The ops"):
//   score(t, j) = scale * (q_nope[t] . ckv[j] + q_rope[t] . krope[j])
//   out[t]      = softmax over the positions j that token t sees, of those scores, times ckv[j]
// The sequences' latent pages are gathered (an FP8 latent read as stored.float() * ckv_scale) and
// the scores computed in float32 (float64 for float64 queries). Tensor ops only: no host
// synchronisation (a decode step stays capturable), differentiable in the queries. The metadata
// handling (which sequence a token belongs to, what it sees, which sequences are poisoned) is
// torch_native_paged's, written for the latent's shapes.
#include <ATen/ATen.h>

#include <limits>
#include <optional>

#include "backends/backends.h"
#include "backends/mla.h"

namespace astr {

AttentionResult torch_native_mla(const MlaAttentionArgs& a) {
  const at::Tensor& q_nope = a.q_nope;  // [T, H, Dc]
  const at::Tensor& q_rope = a.q_rope;  // [T, H, Dr]
  const int64_t tokens = q_nope.size(0), heads = q_nope.size(1);
  const int64_t num_pages = a.ckv_cache.size(0), page_size = a.ckv_cache.size(1);
  const int64_t batch = a.seq_lens.size(0), width = a.block_table.size(1);
  const int64_t capacity = width * page_size;  // the most positions any sequence can have
  const int64_t max_q = a.decode() ? 1 : a.max_query_len;
  const auto long_opts = q_nope.options().dtype(at::kLong);
  const at::ScalarType compute = q_nope.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  constexpr double kInf = std::numeric_limits<double>::infinity();

  // Which sequence each query token belongs to, and its index among that sequence's new tokens.
  const at::Tensor seq_len = a.seq_lens.to(at::kLong);  // [B]
  at::Tensor q_len, seq_of_token, pos_of_token;
  const at::Tensor starts = a.query_start_loc.to(at::kLong);  // [B + 1]
  if (a.decode()) {
    // A decode slot of length 0 is padding: no new token in the cache, zeros out.
    q_len = seq_len.clamp(0, 1);
    seq_of_token = at::arange(tokens, long_opts);
    pos_of_token = at::zeros({tokens}, long_opts);
  } else {
    q_len = starts.slice(0, 1) - starts.slice(0, 0, batch);
    const at::Tensor token = at::arange(tokens, long_opts);
    seq_of_token = (at::searchsorted(starts, token, /*out_int32=*/false, /*right=*/true) - 1)
                       .clamp(0, batch - 1);
    pos_of_token = (token - starts.index_select(0, seq_of_token)).clamp(0, max_q - 1);
  }

  // Every sequence's latents and rotary keys, padded to the table's capacity: [B, capacity, D].
  // Only the slots a sequence owns (positions below its length) may contribute: the others
  // (columns past its pages, the stale tail of its last page) are zeroed, since a masked score
  // still multiplies its value (0 * NaN is NaN).
  const at::Tensor table = a.block_table.to(at::kLong);
  const at::Tensor pages = table.clamp(0, num_pages - 1).reshape({-1});
  const at::Tensor kv_pos = at::arange(capacity, long_opts);
  const at::Tensor owned =
      (kv_pos.view({1, capacity}) < seq_len.view({batch, 1})).view({batch, capacity, 1});
  auto gather = [&](const at::Tensor& pool, const std::optional<at::Tensor>& fp8_scale) {
    const bool bytes = pool.element_size() == 1;  // FP8: gathered as bytes
    at::Tensor rows = bytes ? pool.view(at::kByte).index_select(0, pages).view(pool.scalar_type())
                            : pool.index_select(0, pages);
    rows = rows.view({batch, capacity, pool.size(2)});
    if (bytes) rows = rows.to(at::kFloat) * *fp8_scale;  // stored.float() * scale, in float32
    rows = rows.to(compute);
    return at::where(owned, rows, at::zeros({}, rows.options()));
  };
  const at::Tensor latents = gather(a.ckv_cache, a.ckv_scale);   // [B, capacity, Dc]
  const at::Tensor ropes = gather(a.krope_cache, std::nullopt);  // [B, capacity, Dr]

  // Queries padded per sequence: [B, max_q, H, D].
  auto padded = [&](const at::Tensor& q) {
    at::Tensor rows = at::zeros({batch, max_q, heads, q.size(2)}, q.options().dtype(compute));
    return rows.index_put({seq_of_token, pos_of_token}, q.to(compute));
  };
  const at::Tensor nope = padded(q_nope).view({batch, max_q * heads, -1});
  const at::Tensor rope = padded(q_rope).view({batch, max_q * heads, -1});
  at::Tensor scores =
      (at::matmul(nope, latents.transpose(1, 2)) + at::matmul(rope, ropes.transpose(1, 2))) *
      a.scale;
  scores = scores.view({batch, max_q, heads, capacity});

  // Visibility [B, max_q, 1, capacity]: inside the sequence, and causal from the prefix's end.
  // New token i sits at position seq_len - q_len + i.
  const at::Tensor kv = kv_pos.view({1, 1, capacity});
  const at::Tensor q_pos =
      at::arange(max_q, long_opts).view({1, max_q, 1}) + (seq_len - q_len).view({batch, 1, 1});
  at::Tensor visible = kv < seq_len.view({batch, 1, 1});
  if (a.is_causal) visible = visible.logical_and(kv <= q_pos);
  scores = scores.masked_fill(visible.unsqueeze(2).logical_not(), -kInf);

  // Stable softmax; a row that sees nothing (max -inf) gives out 0 and lse -inf, and its
  // gradients stay finite. A NaN score makes its row's sum NaN: out and lse NaN, as the cuda
  // kernels give them (only a zero sum means "saw nothing").
  at::Tensor top = std::get<0>(scores.max(-1, /*keepdim=*/true));
  top = at::where(at::isinf(top), at::zeros_like(top), top).detach();
  const at::Tensor weights = at::exp(scores - top);
  const at::Tensor sum = weights.sum(-1, /*keepdim=*/true);
  const at::Tensor seen = sum != 0;
  const at::Tensor safe_sum = at::where(seen, sum, at::ones_like(sum));
  const at::Tensor probs = (weights / safe_sum).view({batch, max_q * heads, capacity});
  at::Tensor out = at::matmul(probs, latents).view({batch, max_q, heads, -1});
  at::Tensor lse = at::where(seen, at::log(safe_sum) + top, at::full_like(sum, -kInf)).squeeze(-1);

  // Poison sequences whose metadata is out of range, as torch_native_paged does.
  const at::Tensor valid =
      sequences_in_range(table, seq_len, q_len, page_size, num_pages, max_q,
                         a.decode() ? std::nullopt : std::optional<at::Tensor>(starts), tokens);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  out = at::where(valid.view({batch, 1, 1, 1}), out, at::full({}, nan, out.options()));
  out = out.index({seq_of_token, pos_of_token}).to(q_nope.scalar_type());  // [T, H, Dc]
  if (!a.return_lse) return {out, at::Tensor()};
  lse = at::where(valid.view({batch, 1, 1}), lse, at::full({}, nan, lse.options()));
  return {out, lse.index({seq_of_token, pos_of_token}).to(at::kFloat)};  // [T, H]
}

}  // namespace astr
