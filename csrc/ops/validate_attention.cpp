// The adapter from tensors to csrc/dispatch's CallDescription, and the argument checks that
// every backend relies on.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>
#include <string>

#include "dispatch/capability.h"
#include "ops/append_kv_checks.h"
#include "ops/attention_args.h"
#include "ops/paged_metadata_checks.h"
#include "support/check.h"
#include "support/device_arch.h"
#include "support/kernel_settings.h"
#include "support/torch_scalar_type.h"

namespace astr {

namespace {

using dispatch::CallDescription;
using dispatch::DeviceKind;
using dispatch::MaskForm;
using dispatch::Mode;
DeviceKind device_kind(const at::Device& device) {
  if (device.is_cpu()) return DeviceKind::kCPU;
  if (device.is_cuda()) return DeviceKind::kCUDA;
  return DeviceKind::kOther;
}

MaskForm mask_form(const std::optional<at::Tensor>& mask) {
  if (!mask) return MaskForm::kNone;
  return mask->scalar_type() == at::kBool ? MaskForm::kBoolean : MaskForm::kAdditive;
}

std::string shape_string(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  return s + "]";
}

// "1e+39", "0.125": a double as printf's %g writes it (std::to_string writes 40 digits of it).
std::string number_string(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

void check_same_device(const at::Tensor& q, const at::Tensor& t, const char* name) {
  ASTR_CHECK(t.device() == q.device(), name, ": expected a tensor on ", q.device(),
             " (the device of q), got ", t.device());
}

// A KV-cache pool: q's dtype, or FP8 (the same for both pools; read as stored * scale).
void check_cache_like_q(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& k_cache,
                        const char* name) {
  if (is_fp8(k_cache.scalar_type())) {
    ASTR_CHECK(pool.scalar_type() == k_cache.scalar_type(), name, ": expected dtype ",
               k_cache.scalar_type(), " (k_cache's: an FP8 cache keeps both pools alike), got ",
               pool.scalar_type());
    check_same_device(q, pool, name);
    return;
  }
  ASTR_CHECK(pool.scalar_type() == q.scalar_type(), name, ": expected dtype ", q.scalar_type(),
             " (the dtype of q) or an FP8 pool (float8_e4m3fn, float8_e5m2), got ",
             pool.scalar_type());
  check_same_device(q, pool, name);
}

void check_float_like_q(const at::Tensor& q, const at::Tensor& t, const char* name) {
  ASTR_CHECK(t.scalar_type() == q.scalar_type(), name, ": expected dtype ", q.scalar_type(),
             " (the dtype of q), got ", t.scalar_type());
  check_same_device(q, t, name);
}

void check_metadata(const at::Tensor& q, const at::Tensor& t, const char* name, int64_t rank,
                    const char* layout) {
  ASTR_CHECK(t.dim() == rank, name, ": expected a ", rank, "-D tensor ", layout, ", got shape ",
             shape_string(t));
  ASTR_CHECK(t.scalar_type() == at::kInt, name, ": expected dtype int32, got ", t.scalar_type());
  check_same_device(q, t, name);
}

void check_mask_dtype(const at::Tensor& q, const at::Tensor& mask) {
  ASTR_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == q.scalar_type(),
             "attn_mask: expected dtype bool (True = attend) or ", q.scalar_type(),
             " (additive, like q), got ", mask.scalar_type());
  check_same_device(q, mask, "attn_mask");
}

void validate_dense(const AttentionArgs& a) {
  const at::Tensor& q = a.q;
  ASTR_CHECK(q.dim() == 4, "q: expected a 4-D tensor [batch, q_len, q_heads, head_dim] (BLHD), ",
             "got shape ", shape_string(q));
  ASTR_CHECK(a.k.has_value() && a.v.has_value(),
             "k, v: required for dense calls (pass k_cache and its metadata for paged calls)");
  ASTR_CHECK(!a.block_table && !a.seq_lens && !a.query_start_loc && !a.v_cache,
             "k_cache: block_table/seq_lens/query_start_loc/v_cache given without k_cache");
  const at::Tensor& k = *a.k;
  const at::Tensor& v = *a.v;
  for (auto [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    ASTR_CHECK(t->dim() == 4, name,
               ": expected a 4-D tensor [batch, kv_len, kv_heads, head_dim] (BLHD), got shape ",
               shape_string(*t));
    check_float_like_q(q, *t, name);
    ASTR_CHECK(t->size(0) == q.size(0), name, ": batch ", t->size(0), " does not match q's ",
               q.size(0));
  }
  ASTR_CHECK(k.size(1) == v.size(1), "v: kv_len ", v.size(1), " does not match k's ", k.size(1));
  ASTR_CHECK(k.size(2) == v.size(2), "v: kv_heads ", v.size(2), " does not match k's ", k.size(2));
  ASTR_CHECK(k.size(3) == q.size(3), "k: head_dim ", k.size(3), " does not match q's ", q.size(3));
  ASTR_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, "k: q heads (", q.size(2),
             ") must be a multiple of kv heads (", k.size(2), ")");
  if (a.attn_mask) {
    const at::Tensor& mask = *a.attn_mask;
    check_mask_dtype(q, mask);
    ASTR_CHECK(mask.dim() >= 2 && mask.dim() <= 4,
               "attn_mask: expected 2 to 4 dims broadcastable to [batch, q_heads, q_len, kv_len],"
               " got shape ",
               shape_string(mask));
    const int64_t full[4] = {q.size(0), q.size(2), q.size(1), k.size(1)};
    for (int64_t i = 0; i < mask.dim(); ++i) {
      int64_t target = full[4 - mask.dim() + i];
      int64_t size = mask.size(i);
      ASTR_CHECK(size == 1 || size == target, "attn_mask: shape ", shape_string(mask),
                 " does not broadcast to [batch, q_heads, q_len, kv_len] = [", full[0], ", ",
                 full[1], ", ", full[2], ", ", full[3], "]");
    }
  }
}

// False for tensors whose values cannot be read here: fake and functional tensors while
// torch.compile traces, and meta tensors.
bool has_readable_data(const at::Tensor& t) {
  const c10::DispatchKeySet keys = t.key_set();
  if (t.is_meta() || keys.has(c10::DispatchKey::Python) ||
      keys.has(c10::DispatchKey::Functionalize) || !t.has_storage()) {
    return false;
  }
  // An empty tensor may have no data pointer, and has nothing to read: it is readable.
  return t.numel() == 0 || t.storage().data_ptr().get() != nullptr;
}

// Value checks on the paged metadata: only for CPU tensors, where reading them costs no device
// synchronisation. On the GPU the kernels guard every index and poison the rows of a sequence
// whose metadata is out of range with NaN.
void validate_paged_values(const PagedMetadata& m) {
  // On the GPU (checked mode) the metadata is read back first: a host synchronisation.
  const at::Tensor block_table = m.block_table.cpu().contiguous();
  const at::Tensor seq_lens = m.seq_lens.cpu().contiguous();
  const int64_t batch = seq_lens.size(0);
  const int64_t width = block_table.size(1);
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t num_pages = m.num_pages, page_size = m.page_size;
  std::optional<at::Tensor> starts;
  if (m.query_start_loc) starts = m.query_start_loc->cpu().contiguous();
  const int32_t* start = starts ? starts->data_ptr<int32_t>() : nullptr;
  const std::string q = m.q_name;
  if (start) {
    ASTR_CHECK(start[0] == 0, "query_start_loc: must start at 0, got ", start[0]);
    ASTR_CHECK(start[batch] == m.num_tokens, "query_start_loc: last entry ", start[batch],
               " must equal the number of query tokens (", q, ".size(0) = ", m.num_tokens, ")");
    // Every entry within [0, T] before any difference is taken: an entry near the int32 limits
    // would otherwise give a length that wraps, blamed on max_query_len.
    for (int64_t b = 1; b < batch; ++b) {
      ASTR_CHECK(start[b] >= 0 && start[b] <= m.num_tokens, "query_start_loc: entry ", b, " is ",
                 start[b], ", outside [0, ", m.num_tokens, "] (the query tokens of ", q, ")");
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    int64_t q_len = 1;
    if (m.decode && start) {
      ASTR_CHECK(start[b + 1] - start[b] == 1, "query_start_loc: decode takes one token per ",
                 "sequence (0, 1, ..., batch), entry ", b + 1, " is ", start[b + 1], " after ",
                 start[b]);
    }
    if (!m.decode) {
      ASTR_CHECK(start != nullptr, "query_start_loc: required for paged prefill");
      q_len = static_cast<int64_t>(start[b + 1]) - start[b];
      ASTR_CHECK(q_len >= 0, "query_start_loc: must be non-decreasing, entry ", b + 1, " is ",
                 start[b + 1], " after ", start[b]);
      ASTR_CHECK(q_len <= m.max_query_len, "max_query_len: ", m.max_query_len,
                 " is less than sequence ", b, "'s ", q_len, " new tokens");
    }
    // A decode slot of length 0 is padding (zeros out); otherwise the new tokens are cached.
    const bool padding = m.decode && lens[b] == 0;
    ASTR_CHECK(padding || lens[b] >= q_len, "seq_lens: sequence ", b, " has length ", lens[b],
               ", fewer than its ", q_len, " new tokens (seq_lens counts cached + new tokens)");
    ASTR_CHECK(lens[b] <= width * page_size, "seq_lens: sequence ", b, " has length ", lens[b],
               " but its block_table row holds only ", width, " pages of ", page_size, " tokens");
    const int64_t pages_used = (lens[b] + page_size - 1) / page_size;
    for (int64_t i = 0; i < pages_used; ++i) {
      int32_t page = table[b * width + i];
      ASTR_CHECK(page >= 0 && page < num_pages, "block_table: entry [", b, ", ", i, "] = ", page,
                 " is out of range for a pool of ", num_pages, " pages");
    }
  }
}

void validate_paged(const AttentionArgs& a) {
  const at::Tensor& q = a.q;
  ASTR_CHECK(q.dim() == 3, "q: expected a 3-D tensor [tokens, q_heads, head_dim] for paged ",
             "calls, got shape ", shape_string(q));
  ASTR_CHECK(!a.k && !a.v,
             "k, v: must be None for paged calls; write new tokens with astr::append_kv first");
  ASTR_CHECK(a.call_mode != Mode::kTraining, "mode: paged calls need mode 'prefill' or 'decode'");
  ASTR_CHECK(a.v_cache.has_value(), "v_cache: required with k_cache");
  ASTR_CHECK(a.block_table.has_value(), "block_table: required with k_cache");
  ASTR_CHECK(a.seq_lens.has_value(), "seq_lens: required with k_cache");
  const at::Tensor& k_cache = *a.k_cache;
  const at::Tensor& v_cache = *a.v_cache;
  for (auto [t, name] : {std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"}}) {
    ASTR_CHECK(t->dim() == 4, name,
               ": expected a 4-D tensor [num_pages, page_size, kv_heads, head_dim], got shape ",
               shape_string(*t));
    check_cache_like_q(q, *t, k_cache, name);
  }
  ASTR_CHECK_VALUE(!is_fp8(k_cache.scalar_type()) || (a.k_scale && a.v_scale),
                   "k_scale, v_scale: an FP8 KV cache (", k_cache.scalar_type(),
                   ") needs its float32 [kv_heads] scales (PagedKVCache.k_scales[layer] and "
                   "v_scales[layer])");
  ASTR_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) &&
                 v_cache.size(2) == k_cache.size(2),
             "v_cache: shape ", shape_string(v_cache), " does not match k_cache's ",
             shape_string(k_cache), " in pages, page_size and kv_heads");
  ASTR_CHECK(k_cache.size(3) == q.size(2), "k_cache: head_dim ", k_cache.size(3),
             " does not match q's ", q.size(2));
  ASTR_CHECK(k_cache.size(1) >= 1, "k_cache: page_size must be at least 1");
  ASTR_CHECK(k_cache.size(0) >= 1, "k_cache: expected at least one page, got shape ",
             shape_string(k_cache));
  ASTR_CHECK(k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0, "k_cache: q heads (",
             q.size(1), ") must be a multiple of kv heads (", k_cache.size(2), ")");
  check_metadata(q, *a.block_table, "block_table", 2, "[batch, pages_per_seq]");
  check_metadata(q, *a.seq_lens, "seq_lens", 1, "[batch]");
  const int64_t batch = a.seq_lens->size(0);
  ASTR_CHECK(a.block_table->size(0) == batch, "block_table: has ", a.block_table->size(0),
             " rows, expected one per sequence (", batch, ", from seq_lens)");
  ASTR_CHECK(a.block_table->size(1) >= 1, "block_table: expected at least one page column ",
             "[batch, pages_per_seq >= 1], got shape ", shape_string(*a.block_table));
  ASTR_CHECK(batch > 0 || q.sym_size(0) == 0, "q: ", size_string(q.sym_size(0)),
             " query tokens, but the batch has no sequences (seq_lens is empty)");
  if (a.query_start_loc) {
    check_metadata(q, *a.query_start_loc, "query_start_loc", 1, "[batch + 1]");
    ASTR_CHECK(a.query_start_loc->size(0) == batch + 1, "query_start_loc: has ",
               a.query_start_loc->size(0), " entries, expected batch + 1 = ", batch + 1);
  } else {
    ASTR_CHECK(a.decode(), "query_start_loc: required for paged prefill");
  }
  if (a.decode()) {
    ASTR_CHECK(q.size(0) == batch, "q: decode takes one token per sequence: expected ", batch,
               " tokens (from seq_lens), got ", q.size(0));
  } else {
    ASTR_CHECK(a.max_query_len >= 1, "max_query_len: required for paged prefill: the largest ",
               "number of new tokens of any sequence (a host int, so no op reads lengths back)");
  }
  if (a.attn_mask) {
    check_mask_dtype(q, *a.attn_mask);
    ASTR_CHECK(a.attn_mask->dim() == 2 && a.attn_mask->size(0) == q.size(0),
               "attn_mask: paged calls take a 2-D mask [tokens, kv_positions] with one row per "
               "query token (",
               q.size(0), "), got shape ", shape_string(*a.attn_mask));
  }
  check_paged_metadata_values({*a.block_table, *a.seq_lens,
                               a.query_start_loc ? &*a.query_start_loc : nullptr, q.size(0),
                               a.max_query_len, a.decode(), k_cache.size(0), k_cache.size(1), "q"});
}

// "[a, b, ...]", "?" for a symbolic stride (c10's stream operator for SymInt arrays is not used:
// it crashed with torch 2.11's library).
std::string strides_string(const at::Tensor& t) {
  std::string text = "[";
  const auto strides = t.sym_strides();
  for (size_t d = 0; d < strides.size(); ++d) {
    if (d) text += ", ";
    const auto value = strides[d].maybe_as_int();
    text += value ? std::to_string(*value) : std::string("?");
  }
  return text + "]";
}

// The cuda kernels copy rows in 16-byte pieces (cp.async) and address a pool page with 32-bit
// byte offsets (csrc/kernels/paged_kv_tile_loader.cuh). A tensor outside those rules is a reason
// for the resolver to pass the cuda backend by (an implicit choice then falls back), not an error.
// Returns the first problem, or "" when there is none. Strides and offsets unknown while tracing
// with symbolic shapes count as fine; the binding checks the real tensors again (also the data
// pointer's alignment, which a storage offset alone cannot show).
std::string cuda_layout_problem(const at::Tensor& t, const char* name, bool is_cache) {
  if (t.element_size() != 2) return "";    // other dtypes are rejected by the dtype rule
  constexpr int64_t kPer16Bytes = 8;       // 16-bit elements in 16 bytes
  constexpr int64_t kMaxSpan = INT32_MAX;  // bytes of a page, and of the slots of one page
  const auto strides = t.sym_strides();
  const auto sizes = t.sym_sizes();
  const int64_t rank = t.dim();
  if (rank == 0) return "";
  const auto last = strides[rank - 1].maybe_as_int();
  if (last && *last != 1) {
    return std::string(name) + " needs a contiguous last dim (stride 1), got strides " +
           strides_string(t);
  }
  for (int64_t d = 0; d + 1 < rank; ++d) {
    const auto stride = strides[d].maybe_as_int();
    const auto size = sizes[d].maybe_as_int();
    if (stride && size && *size != 1 && (*stride < 0 || *stride % kPer16Bytes != 0)) {
      return std::string(name) + " strides " + strides_string(t) +
             " must be multiples of 8 elements (16-byte rows)";
    }
  }
  const auto offset = t.sym_storage_offset().maybe_as_int();
  if (offset && *offset % kPer16Bytes != 0) {
    return std::string(name) + " must start on a 16-byte boundary (storage offset " +
           std::to_string(*offset) + " elements)";
  }
  if (is_cache && rank == 4) {
    const auto page_stride = strides[0].maybe_as_int();
    const auto slot_stride = strides[1].maybe_as_int();
    const auto page_size = sizes[1].maybe_as_int();
    if (page_stride && *page_stride * 2 > kMaxSpan) {
      return std::string(name) + " pages must span under 2 GiB (page stride " +
             std::to_string(*page_stride) + " elements)";
    }
    if (slot_stride && page_size && *slot_stride * 2 * *page_size > kMaxSpan) {
      return std::string(name) + " slots of one page must span under 2 GiB (slot stride " +
             std::to_string(*slot_stride) + " elements, page size " + std::to_string(*page_size) +
             ")";
    }
  }
  return "";
}

// The first cuda layout problem of q and the pools (v_cache may be absent: describe_form).
std::string cuda_layout_of(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor* v_cache) {
  std::string problem = cuda_layout_problem(q, "q", false);
  if (problem.empty()) problem = cuda_layout_problem(k_cache, "k_cache", true);
  if (problem.empty() && v_cache != nullptr)
    problem = cuda_layout_problem(*v_cache, "v_cache", true);
  return problem;
}

// topk_indices' values, where reading them costs no synchronisation: each entry is -1 (unused)
// or a key position of its query's sequence, [0, kv_len) dense, [0, seq_lens[b]) paged.
void validate_topk_values(const AttentionArgs& a) {
  const at::Tensor indices = a.topk_indices->cpu().contiguous();
  const int64_t topk = indices.size(-1);
  const int32_t* index = indices.data_ptr<int32_t>();
  const int64_t rows = topk == 0 ? 0 : indices.numel() / topk;
  std::optional<at::Tensor> lens, starts;
  int64_t kv_len = 0;
  if (a.paged()) {
    lens = a.seq_lens->cpu().contiguous();
    if (!a.decode()) starts = a.query_start_loc->cpu().contiguous();
  } else {
    kv_len = a.k->size(1);
  }
  int64_t sequence = 0;
  for (int64_t row = 0; row < rows; ++row) {
    if (a.paged()) {
      // Token `row` belongs to the sequence whose query_start_loc range holds it.
      if (starts) {
        const int32_t* start = starts->data_ptr<int32_t>();
        while (start[sequence + 1] <= row) ++sequence;
      } else {
        sequence = row;
      }
      kv_len = lens->data_ptr<int32_t>()[sequence];
      if (a.decode() && kv_len == 0) continue;  // a padding slot: zeros, whatever it lists
    }
    for (int64_t j = 0; j < topk; ++j) {
      const int32_t position = index[row * topk + j];
      ASTR_CHECK_VALUE(position == -1 || (position >= 0 && position < kv_len),
                       "topk_indices: entry ", j, " of query row ", row, " is ", position,
                       ", expected -1 (unused) or a key position in [0, ", kv_len, ") (",
                       a.paged() ? "the length of its sequence" : "kv_len", ")");
    }
  }
}

void validate_topk_indices(const AttentionArgs& a) {
  const at::Tensor& q = a.q;
  const at::Tensor& indices = *a.topk_indices;
  ASTR_CHECK_VALUE(indices.scalar_type() == at::kInt, "topk_indices: expected dtype int32, got ",
                   indices.scalar_type());
  check_same_device(q, indices, "topk_indices");
  if (a.paged()) {
    ASTR_CHECK_VALUE(indices.dim() == 2 && indices.size(0) == q.size(0),
                     "topk_indices: paged calls take [tokens, topk] with one row per query "
                     "token (",
                     q.size(0), "), got shape ", shape_string(indices));
  } else {
    ASTR_CHECK_VALUE(
        indices.dim() == 3 && indices.size(0) == q.size(0) && indices.size(1) == q.size(1),
        "topk_indices: dense calls take [batch, q_len, topk] = [", q.size(0), ", ", q.size(1),
        ", topk], got shape ", shape_string(indices));
  }
  const bool readable =
      has_readable_data(indices) &&
      (!a.paged() || (has_readable_data(*a.seq_lens) &&
                      (!a.query_start_loc || has_readable_data(*a.query_start_loc))));
  if (readable && (indices.device().is_cpu() || metadata_checks_enabled())) {
    validate_topk_values(a);
  }
}

// A tree mask (params.h has the definition): which new tokens of its own sequence each new token
// of a paged prefill sees, the cached prefix staying visible. It replaces the causal triangle among
// the new tokens, so it needs is_causal (a non-causal call has no prefix to keep) and excludes
// attn_mask (whose [T, K] rows can spell out a tree themselves: two masks would have to agree on
// which one decides). At least max_query_len columns: column j is the sequence's new token j (a
// bound past the call's token count counts as that count, so a wider mask is fine).
void validate_tree_mask(const AttentionArgs& a) {
  const at::Tensor& q = a.q;
  const at::Tensor& tree = *a.tree_mask;
  ASTR_CHECK_VALUE(a.paged() && a.call_mode == Mode::kPrefill,
                   "tree_mask: only for paged calls with mode='prefill' (several new tokens per "
                   "sequence over k_cache), got a ",
                   a.paged() ? "decode" : "dense", " call");
  ASTR_CHECK_VALUE(a.is_causal,
                   "tree_mask: needs is_causal=True (the tree takes the place of the causal "
                   "triangle among a sequence's new tokens; its cached prefix stays visible), got "
                   "is_causal=False");
  ASTR_CHECK_VALUE(!a.attn_mask,
                   "tree_mask, attn_mask: give one of them (an attn_mask [tokens, kv_positions] "
                   "can spell out a tree over the kv positions itself)");
  const bool shaped = tree.scalar_type() == at::kBool && tree.dim() == 2 &&
                      tree.sym_size(0) == q.sym_size(0) && tree.sym_size(1) >= a.max_query_len;
  ASTR_CHECK_VALUE(shaped, "tree_mask: expected a bool tensor [tokens, max_query_len] = [",
                   size_string(q.sym_size(0)), ", ", a.max_query_len,
                   "] (row t: which new tokens of its sequence token t sees), got ",
                   tree.scalar_type(), " of shape ", shape_string(tree));
  check_same_device(q, tree, "tree_mask");
}

// The variants' arguments (their meaning: csrc/kernels/paged_attention/params.h; topk_indices:
// csrc/README.md), and the FP8 cache's scales. Whether a backend implements them is the
// capability rules' question.
void validate_variants(const AttentionArgs& a) {
  const at::Tensor& q = a.q;
  ASTR_CHECK_VALUE(a.window_left >= -1 && a.window_left <= INT32_MAX,
                   "window_left: expected -1 (no window) or a window of 0 to 2^31 - 1 earlier "
                   "positions, got ",
                   a.window_left);
  ASTR_CHECK_VALUE(a.window_left < 0 || a.is_causal,
                   "window_left: needs is_causal=True (a query at position p sees keys p - "
                   "window_left .. p), got is_causal=False");
  if (a.softcap) {
    // The kernels take it as a float32: beyond float32's range it is inf (every score NaN), and
    // below its smallest normal 0 or a subnormal (s / softcap overflows).
    const double cap = *a.softcap;
    ASTR_CHECK_VALUE(std::isfinite(cap) && cap >= FLT_MIN && cap <= FLT_MAX,
                     "softcap: expected None or a finite value > 0 within float32's range (",
                     number_string(FLT_MIN), " to ", number_string(FLT_MAX), "), got ",
                     number_string(cap));
  }
  const int64_t q_heads = q.size(-2);
  if (a.sinks) {
    const at::Tensor& sinks = *a.sinks;
    ASTR_CHECK_VALUE(
        sinks.scalar_type() == at::kFloat && sinks.dim() == 1 && sinks.size(0) == q_heads,
        "sinks: expected a float32 tensor of shape [q_heads] = [", q_heads, "], got ",
        sinks.scalar_type(), " of shape ", shape_string(sinks));
    check_same_device(q, sinks, "sinks");
  }
  if (a.tree_mask) validate_tree_mask(a);
  ASTR_CHECK_VALUE(a.k_scale.has_value() == a.v_scale.has_value(),
                   "k_scale, v_scale: give both or neither");
  if (a.k_scale) {
    const int64_t kv_heads = a.paged() ? a.k_cache->size(2) : a.k->size(2);
    for (auto [t, name] : {std::pair{&*a.k_scale, "k_scale"}, std::pair{&*a.v_scale, "v_scale"}}) {
      ASTR_CHECK_VALUE(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == kv_heads,
                       name, ": expected a float32 tensor of shape [kv_heads] = [", kv_heads,
                       "], got ", t->scalar_type(), " of shape ", shape_string(*t));
      check_same_device(q, *t, name);
    }
    // Their values (a scale of 0, below 0, NaN or inf reads every stored value wrong), where
    // reading them costs no synchronisation: CPU tensors, or the checked mode.
    for (auto [t, name] : {std::pair{&*a.k_scale, "k_scale"}, std::pair{&*a.v_scale, "v_scale"}}) {
      if (has_readable_data(*t) && (t->device().is_cpu() || metadata_checks_enabled())) {
        check_positive_finite_scale(*t, name);
      }
    }
  }
  if (a.topk_indices) validate_topk_indices(a);
}

// The variants a call asks for (ASTR_VARIANTS' fields).
void describe_variants(const AttentionArgs& a, CallDescription& call) {
  call.window = a.window_left >= 0;
  call.softcap = a.softcap.has_value();
  call.sinks = a.sinks.has_value();
  call.lse = a.return_lse;
  call.topk = a.topk_indices.has_value();
  if (a.topk_indices) {
    // A symbolic width (traced with dynamic shapes) is unknown here: -1.
    const std::optional<int64_t> entries = a.topk_indices->sym_size(-1).maybe_as_int();
    call.topk_entries = entries.value_or(-1);
  }
  call.tree_mask = a.tree_mask.has_value();
}

bool any_requires_grad(const AttentionArgs& a) {
  if (!c10::GradMode::is_enabled()) return false;
  bool grad = a.q.requires_grad();
  for (const auto* t : {&a.k, &a.v, &a.attn_mask, &a.k_cache, &a.v_cache, &a.sinks}) {
    if (t->has_value()) grad |= (*t)->requires_grad();
  }
  return grad;
}

}  // namespace

void check_paged_metadata_values(const PagedMetadata& metadata) {
  const bool readable = has_readable_data(metadata.block_table) &&
                        has_readable_data(metadata.seq_lens) &&
                        (!metadata.query_start_loc || has_readable_data(*metadata.query_start_loc));
  // CPU metadata is always validated (reading it costs no synchronisation); GPU metadata in the
  // checked mode (kernel_settings.h), where a bad value raises here instead of giving NaN rows.
  if (!readable || !(metadata.seq_lens.device().is_cpu() || metadata_checks_enabled())) return;
  try {
    validate_paged_values(metadata);
  } catch (const c10::Error& error) {
    const std::string what = error.what_without_backtrace();
    const bool capture = what.find("capture") != std::string::npos;
    ASTR_CHECK(!capture,
               "metadata checks (ASTR_CHECK_METADATA / set_metadata_checks) read the paged "
               "metadata back to the host, which a CUDA graph capture does not allow: turn them "
               "off while capturing (",
               what, ")");
    throw;
  }
}

bool has_readable_values(const at::Tensor& t) { return has_readable_data(t); }

AttentionArgs::AttentionArgs(const at::Tensor& q ASTR_ATTENTION_PARAMS, bool return_lse)
    : q(q)
#define ASTR_ATTENTION_INIT(name, type, default_value, cpp_type) , name(name)
          ASTR_ATTENTION_ARGS(ASTR_ATTENTION_INIT)
#undef ASTR_ATTENTION_INIT
      ,
      return_lse(return_lse),
      call_mode(parse_mode(mode)) {
}

double AttentionArgs::resolved_scale() const {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim()));
}

Mode parse_mode(std::optional<c10::string_view> mode) {
  if (!mode.has_value()) return Mode::kTraining;
  std::string name(mode->data(), mode->size());
  if (name == "prefill") return Mode::kPrefill;
  if (name == "decode") return Mode::kDecode;
  ASTR_CHECK_VALUE(false, "mode: expected None, 'prefill' or 'decode', got '", name, "'");
}

CallDescription validate_and_describe(const AttentionArgs& a) {
  ASTR_CHECK(a.q.is_floating_point(), "q: expected a floating-point tensor, got ",
             a.q.scalar_type());
  ASTR_CHECK_VALUE(!is_fp8(a.q.scalar_type()), "q: an FP8 q is not supported (got ",
                   a.q.scalar_type(),
                   "): keep q, k and v in the model's dtype; the KV cache may be FP8");
  // A NaN or infinite scale turns every score into NaN or +-inf: the output would be NaN or
  // (rows where every key is -inf) zeros, never an error.
  ASTR_CHECK_VALUE(!a.scale || std::isfinite(*a.scale), "scale: expected a finite number, got ",
                   std::to_string(*a.scale));
  // Every backend multiplies scores by it in float32 (or folds it into a float32 exponent): past
  // float32's range it is inf there, and every output NaN.
  ASTR_CHECK_VALUE(!a.scale || std::abs(*a.scale) <= FLT_MAX,
                   "scale: expected a number within float32's range (|scale| <= ",
                   number_string(FLT_MAX), "), got ", number_string(*a.scale));
  if (a.paged()) {
    validate_paged(a);
  } else {
    validate_dense(a);
  }
  validate_variants(a);
  CallDescription call;
  call.dtype = scalar_type_of(a.q.scalar_type());
  call.device = device_kind(a.q.device());
  call.arch = call.device == DeviceKind::kCUDA ? cuda_device_arch(a.q.get_device()) : 0;
  call.q_rank = static_cast<int>(a.q.dim());
  call.head_dim = static_cast<int>(a.q.size(-1));
  call.num_q_heads = static_cast<int>(a.q.size(-2));
  call.has_kv_cache = a.paged();
  if (a.paged()) {
    call.head_dim_v = static_cast<int>(a.v_cache->size(3));
    call.num_kv_heads = static_cast<int>(a.k_cache->size(2));
    call.page_size = static_cast<int>(a.k_cache->size(1));
    call.cuda_layout = cuda_layout_of(a.q, *a.k_cache, &*a.v_cache);
  } else {
    call.head_dim_v = static_cast<int>(a.v->size(3));
    call.num_kv_heads = static_cast<int>(a.k->size(2));
    call.q_len_equals_kv_len = a.q.size(1) == a.k->size(1);
  }
  call.mask = mask_form(a.attn_mask);
  call.mode = a.call_mode;
  const int64_t query_len = a.paged() ? a.max_query_len : a.q.size(1);
  for (int64_t length = query_len; length > 1; length >>= 1) ++call.query_len_log2;
  call.needs_grad = any_requires_grad(a);
  call.is_causal = a.is_causal;
  describe_variants(a, call);
  call.kv_dtype = scalar_type_of((a.paged() ? *a.k_cache : *a.k).scalar_type());
  call.kv_scales = a.k_scale.has_value();
  return call;
}

CallDescription describe_form(const at::Tensor& q, const std::optional<at::Tensor>& k_cache,
                              const std::optional<at::Tensor>& attn_mask, bool is_causal, Mode mode,
                              const std::optional<at::Tensor>& v_cache) {
  ASTR_CHECK(q.dim() >= 1, "q: expected [..., q_heads, head_dim], got a 0-d tensor");
  CallDescription call;
  call.dtype = scalar_type_of(q.scalar_type());
  call.device = device_kind(q.device());
  call.arch = call.device == DeviceKind::kCUDA ? cuda_device_arch(q.get_device()) : 0;
  call.q_rank = static_cast<int>(q.dim());
  call.head_dim = static_cast<int>(q.size(-1));
  call.head_dim_v = call.head_dim;
  call.num_q_heads = static_cast<int>(q.dim() >= 2 ? q.size(-2) : 0);
  call.num_kv_heads = call.num_q_heads;
  call.has_kv_cache = k_cache.has_value();
  if (k_cache) {
    ASTR_CHECK(k_cache->dim() == 4,
               "k_cache: expected a 4-D tensor [num_pages, page_size, kv_heads, head_dim], got "
               "shape ",
               shape_string(*k_cache));
    call.num_kv_heads = static_cast<int>(k_cache->size(2));
    call.page_size = static_cast<int>(k_cache->size(1));
    ASTR_CHECK(!v_cache || v_cache->dim() == 4,
               "v_cache: expected a 4-D tensor [num_pages, page_size, kv_heads, head_dim], got "
               "shape ",
               shape_string(*v_cache));
    if (v_cache) call.head_dim_v = static_cast<int>(v_cache->size(3));
    call.cuda_layout = cuda_layout_of(q, *k_cache, v_cache ? &*v_cache : nullptr);
  }
  call.mask = mask_form(attn_mask);
  call.mode = mode;
  call.needs_grad = c10::GradMode::is_enabled() && q.requires_grad();
  call.is_causal = is_causal;
  call.kv_dtype = k_cache ? scalar_type_of(k_cache->scalar_type()) : call.dtype;
  return call;
}

void validate_variant_args(const AttentionArgs& args, dispatch::Backend backend) {
  validate_variants(args);
  CallDescription call;
  describe_variants(args, call);
  std::vector<std::string> missing;
  dispatch::check_variants(backend, call, missing);
  TORCH_CHECK_NOT_IMPLEMENTED(missing.empty(), missing.empty() ? "" : missing.front());
}

}  // namespace astr
