#include "backends/cuda/paged_attention_checks.h"

#include <cmath>
#include <cstdint>
#include <utility>

#include "kernels/paged_attention/config.h"
#include "support/check.h"
#include "support/torch_scalar_type.h"

namespace astr::backends {

namespace {

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  ASTR_CHECK(t.is_cuda(), "cuda_paged_attention: ", name, " must be a CUDA tensor, got device ",
             t.device());
  ASTR_CHECK(t.device() == device, "cuda_paged_attention: ", name, " must be on ", device,
             " (the device of q), got ", t.device());
}

void check_int32_vector(const at::Tensor& t, const char* name, int64_t expected_len) {
  ASTR_CHECK(t.scalar_type() == at::kInt, "cuda_paged_attention: ", name, " must be int32, got ",
             t.scalar_type());
  ASTR_CHECK(t.dim() == 1 && t.size(0) == expected_len, "cuda_paged_attention: ", name,
             " must have shape [", expected_len, "], got ", t.sizes());
}

// Every tensor argument: on q's CUDA device, its last dim contiguous (the kernels index rows
// and vectors by element). The others need nothing here.
void check_argument(const std::optional<at::Tensor>& t, const char* name,
                    const at::Device& device) {
  if (!t) return;
  check_cuda_tensor(*t, name, device);
  ASTR_CHECK(t->dim() == 0 || t->stride(-1) == 1 || t->size(-1) <= 1,
             "cuda_paged_attention: ", name, " must have a contiguous last dim, got strides ",
             t->strides());
}
template <typename T>
void check_argument(const T&, const char*, const at::Device&) {}

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

}  // namespace

PagedCallShape check_cuda_paged_call(const AttentionArgs& a) {
  const at::Tensor& q = a.q;
  ASTR_CHECK(a.k_cache && a.v_cache && a.block_table && a.seq_lens && !a.k && !a.v,
             "cuda_paged_attention: needs k_cache, v_cache, block_table and seq_lens, and no k/v");
  ASTR_CHECK(a.call_mode != dispatch::Mode::kTraining,
             "cuda_paged_attention: mode must be 'prefill' or 'decode'");
  const at::Tensor& k_cache = *a.k_cache;
  const at::Tensor& v_cache = *a.v_cache;
  const at::Tensor& block_table = *a.block_table;
  ASTR_CHECK(q.is_cuda(), "cuda_paged_attention: q must be a CUDA tensor, got device ", q.device());
  const at::Device device = q.device();
  ASTR_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
             "cuda_paged_attention: q must be bfloat16 or float16, got ", q.scalar_type());
  ASTR_CHECK(q.dim() == 3, "cuda_paged_attention: q must have shape [T, Hq, D] (rank 3), got ",
             q.sizes());
#define ASTR_CHECK_ARGUMENT(name, type, default_value, cpp_type) \
  check_argument(a.name, #name, device);
  ASTR_ATTENTION_ARGS(ASTR_CHECK_ARGUMENT)
#undef ASTR_CHECK_ARGUMENT
  // The variants' arguments and the FP8 scales: the op's own rules; a variant the kernels lack
  // (ASTR_VARIANTS' cuda column) raises.
  validate_variant_args(a, dispatch::Backend::kCuda);
  PagedCallShape shape;
  shape.num_tokens = q.size(0);
  shape.num_q_heads = q.size(1);
  shape.head_dim = q.size(2);
  check_16_byte_rows(q, "q");

  // The cache holds q's dtype, or FP8 (e4m3 / e5m2, the same for k and v) with per-head scales.
  shape.fp8 = is_fp8(k_cache.scalar_type());
  for (const auto& [cache, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    ASTR_CHECK(cache->scalar_type() == q.scalar_type() ||
                   (shape.fp8 && cache->scalar_type() == k_cache.scalar_type()),
               "cuda_paged_attention: ", name, " must have the dtype of q (", q.scalar_type(),
               ") or be an FP8 pool (float8_e4m3fn or float8_e5m2, both pools alike), got ",
               cache->scalar_type());
    ASTR_CHECK(cache->dim() == 4, "cuda_paged_attention: ", name,
               " must have shape [P, S, Hkv, D] (rank 4), got ", cache->sizes());
    check_16_byte_rows(*cache, name);
  }
  ASTR_CHECK(k_cache.size(3) == shape.head_dim, "cuda_paged_attention: k_cache head dim ",
             k_cache.size(3), " must equal q's head dim ", shape.head_dim);
  ASTR_CHECK(v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3),
             "cuda_paged_attention: v_cache shape ", v_cache.sizes(), " must equal k_cache shape ",
             k_cache.sizes(), " but for the head dim");
  // The head-dim pair: a row of config.h's list (v's head dim differs only where a row says so).
  shape.head_dim_v = v_cache.size(3);
  ASTR_CHECK(kernels::paged_head_dim_forms(static_cast<int>(shape.head_dim),
                                           static_cast<int>(shape.head_dim_v)) != nullptr,
             "cuda_paged_attention: q, v_cache: ",
             kernels::unsupported_head_dim_message(static_cast<int>(shape.head_dim),
                                                   static_cast<int>(shape.head_dim_v)));
  shape.page_size = k_cache.size(1);
  shape.num_kv_heads = k_cache.size(2);
  shape.num_pages = k_cache.size(0);
  ASTR_CHECK(shape.page_size >= 1 && (shape.page_size & (shape.page_size - 1)) == 0,
             "cuda_paged_attention: k_cache page size (dim 1) must be a power of two, got ",
             shape.page_size);
  ASTR_CHECK(shape.num_kv_heads >= 1 && shape.num_q_heads % shape.num_kv_heads == 0,
             "cuda_paged_attention: q heads (", shape.num_q_heads,
             ") must be a multiple of k_cache kv heads (", shape.num_kv_heads, ")");
  ASTR_CHECK(shape.num_pages >= 1 && shape.num_pages <= INT32_MAX,
             "cuda_paged_attention: k_cache must hold 1 to 2^31 - 1 pages, got ", shape.num_pages);
  if (shape.fp8) {
    ASTR_CHECK(a.k_scale.has_value() && a.v_scale.has_value(),
               "cuda_paged_attention: an FP8 KV cache needs k_scale and v_scale (float32 [Hkv])");
  } else {
    ASTR_CHECK(!a.k_scale && !a.v_scale,
               "cuda_paged_attention: k_scale/v_scale are only for an FP8 KV cache");
  }

  ASTR_CHECK(block_table.scalar_type() == at::kInt,
             "cuda_paged_attention: block_table must be int32, got ", block_table.scalar_type());
  ASTR_CHECK(block_table.dim() == 2,
             "cuda_paged_attention: block_table must have shape [B, W], got ", block_table.sizes());
  shape.num_seqs = block_table.size(0);
  shape.width = block_table.size(1);
  check_int32_vector(*a.seq_lens, "seq_lens", shape.num_seqs);
  if (a.decode()) {
    ASTR_CHECK(shape.num_tokens == shape.num_seqs,
               "cuda_paged_attention: decode needs one token per sequence: q has ",
               shape.num_tokens, " tokens, block_table has ", shape.num_seqs, " sequences");
  } else {
    ASTR_CHECK(a.query_start_loc.has_value(),
               "cuda_paged_attention: query_start_loc is required for a prefill");
    check_int32_vector(*a.query_start_loc, "query_start_loc", shape.num_seqs + 1);
    ASTR_CHECK(a.max_query_len >= 0, "cuda_paged_attention: max_query_len must be >= 0, got ",
               a.max_query_len);
    ASTR_CHECK(shape.num_tokens == 0 || a.max_query_len > 0,
               "cuda_paged_attention: max_query_len must be >= 1 when q has tokens");
  }
  if (a.attn_mask.has_value()) {
    const at::Tensor& mask = *a.attn_mask;
    ASTR_CHECK(mask.scalar_type() == at::kBool,
               "cuda_paged_attention: attn_mask must be bool (True = attend), got ",
               mask.scalar_type());
    ASTR_CHECK(mask.dim() == 2 && mask.size(0) == shape.num_tokens,
               "cuda_paged_attention: attn_mask must have shape [T, K] with T = ", shape.num_tokens,
               ", got ", mask.sizes());
  }
  const double scale = a.resolved_scale();
  ASTR_CHECK(std::isfinite(scale), "cuda_paged_attention: scale must be finite, got ", scale);
  ASTR_CHECK(shape.num_tokens <= INT32_MAX && shape.num_seqs <= INT32_MAX,
             "cuda_paged_attention: too many tokens");
  return shape;
}

}  // namespace astr::backends
