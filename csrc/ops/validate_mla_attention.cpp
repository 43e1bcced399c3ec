// astr::mla_attention's argument checks, and the adapter from its tensors to csrc/dispatch's
// CallDescription.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "ops/append_kv_checks.h"
#include "ops/mla_attention_args.h"
#include "ops/paged_metadata_checks.h"
#include "support/check.h"
#include "support/device_arch.h"
#include "support/kernel_settings.h"
#include "support/torch_scalar_type.h"

namespace astr {

namespace {

using dispatch::CallDescription;
using dispatch::DeviceKind;
using dispatch::Mode;

// "1e+39", "0.125": a double as printf's %g writes it.
std::string number_string(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

dispatch::Mode parse_mla_mode(c10::string_view mode) {
  const std::string name(mode.data(), mode.size());
  if (name == "prefill") return Mode::kPrefill;
  if (name == "decode") return Mode::kDecode;
  ASTR_CHECK_VALUE(false, "mode: expected 'prefill' or 'decode', got '", name, "'");
}

void check_on_device_of_q(const at::Tensor& q_nope, const at::Tensor& t, const char* name) {
  ASTR_CHECK(t.device() == q_nope.device(), name, ": expected a tensor on ", q_nope.device(),
             " (the device of q_nope), got ", t.device());
}

void check_metadata(const at::Tensor& q_nope, const at::Tensor& t, const char* name, int64_t rank,
                    const char* layout) {
  ASTR_CHECK(t.dim() == rank, name, ": expected a ", rank, "-D tensor ", layout, ", got shape ",
             t.sizes());
  ASTR_CHECK(t.scalar_type() == at::kInt, name, ": expected dtype int32, got ", t.scalar_type());
  check_on_device_of_q(q_nope, t, name);
}

// The cuda kernel reads rows in 16-byte pieces: a tensor outside that rule is a reason for the
// resolver to pass the cuda backend by (an implicit choice then falls back), not an error.
// Returns the first problem, or "". Unknown (symbolic) strides count as fine: the binding checks
// the real tensors again, the data pointer's alignment too.
std::string cuda_layout_problem(const at::Tensor& t, const char* name) {
  const int64_t element = t.element_size();
  if (element != 1 && element != 2) return "";  // the dtype rule rejects the others
  const int64_t per_16_bytes = 16 / element;
  const auto strides = t.sym_strides();
  const auto sizes = t.sym_sizes();
  const int64_t rank = t.dim();
  const auto last = strides[rank - 1].maybe_as_int();
  if (last && *last != 1) {
    return std::string(name) + " needs a contiguous last dim (stride 1)";
  }
  for (int64_t d = 0; d + 1 < rank; ++d) {
    const auto stride = strides[d].maybe_as_int();
    const auto size = sizes[d].maybe_as_int();
    if (stride && size && *size != 1 && (*stride < 0 || *stride % per_16_bytes != 0)) {
      return std::string(name) + " strides must be multiples of 16 bytes";
    }
  }
  const auto offset = t.sym_storage_offset().maybe_as_int();
  if (offset && *offset % per_16_bytes != 0) {
    return std::string(name) + " must start on a 16-byte boundary (storage offset " +
           std::to_string(*offset) + " elements)";
  }
  return "";
}

bool any_requires_grad(const MlaAttentionArgs& a) {
  if (!c10::GradMode::is_enabled()) return false;
  return a.q_nope.requires_grad() || a.q_rope.requires_grad() || a.ckv_cache.requires_grad() ||
         a.krope_cache.requires_grad();
}

void validate_queries(const MlaAttentionArgs& a) {
  const at::Tensor& q = a.q_nope;
  ASTR_CHECK(q.is_floating_point(), "q_nope: expected a floating-point tensor, got ",
             q.scalar_type());
  ASTR_CHECK_VALUE(!is_fp8(q.scalar_type()), "q_nope: an FP8 query is not supported (got ",
                   q.scalar_type(), "): keep the queries in the model's dtype; the latent cache ",
                   "may be FP8");
  ASTR_CHECK(q.dim() == 3, "q_nope: expected a 3-D tensor [tokens, heads, latent_dim], got shape ",
             q.sizes());
  ASTR_CHECK(a.q_rope.dim() == 3,
             "q_rope: expected a 3-D tensor [tokens, heads, rope_dim], got shape ",
             a.q_rope.sizes());
  ASTR_CHECK(a.q_rope.scalar_type() == q.scalar_type(), "q_rope: expected dtype ", q.scalar_type(),
             " (the dtype of q_nope), got ", a.q_rope.scalar_type());
  check_on_device_of_q(q, a.q_rope, "q_rope");
  ASTR_CHECK(a.q_rope.size(0) == q.size(0) && a.q_rope.size(1) == q.size(1), "q_rope: shape ",
             a.q_rope.sizes(), " does not match q_nope's ", q.sizes(), " in tokens and heads");
  ASTR_CHECK(q.size(1) >= 1 && q.size(2) >= 1 && a.q_rope.size(2) >= 1,
             "q_nope, q_rope: expected at least one head, one latent and one rope element, got "
             "shapes ",
             q.sizes(), " and ", a.q_rope.sizes());
  // Every backend multiplies scores by the scale in float32: NaN, inf or past float32's range
  // would make every output NaN (or zeros), never an error.
  ASTR_CHECK_VALUE(std::isfinite(a.scale) && std::abs(a.scale) <= FLT_MAX,
                   "scale: expected a finite number within float32's range (|scale| <= ",
                   number_string(FLT_MAX), "), got ", number_string(a.scale));
}

void validate_pools(const MlaAttentionArgs& a) {
  const at::Tensor& q = a.q_nope;
  const at::Tensor& ckv = a.ckv_cache;
  const at::Tensor& krope = a.krope_cache;
  ASTR_CHECK(ckv.dim() == 3,
             "ckv_cache: expected a 3-D tensor [num_pages, page_size, latent_dim], got shape ",
             ckv.sizes());
  ASTR_CHECK(krope.dim() == 3,
             "krope_cache: expected a 3-D tensor [num_pages, page_size, rope_dim], got shape ",
             krope.sizes());
  const bool fp8 = is_fp8(ckv.scalar_type());
  ASTR_CHECK(!fp8 || ckv.scalar_type() == at::kFloat8_e4m3fn,
             "ckv_cache: an FP8 latent cache holds float8_e4m3fn, got ", ckv.scalar_type());
  ASTR_CHECK(fp8 || ckv.scalar_type() == q.scalar_type(), "ckv_cache: expected dtype ",
             q.scalar_type(), " (the dtype of q_nope) or float8_e4m3fn (with ckv_scale), got ",
             ckv.scalar_type());
  check_on_device_of_q(q, ckv, "ckv_cache");
  ASTR_CHECK(krope.scalar_type() == q.scalar_type(), "krope_cache: expected dtype ",
             q.scalar_type(),
             " (the dtype of q_nope; the rotary keys stay in the model's dtype beside an FP8 "
             "latent), got ",
             krope.scalar_type());
  check_on_device_of_q(q, krope, "krope_cache");
  ASTR_CHECK(ckv.size(0) >= 1 && ckv.size(1) >= 1, "ckv_cache: expected at least one page of at ",
             "least one slot, got shape ", ckv.sizes());
  ASTR_CHECK(ckv.size(2) == q.size(2), "ckv_cache: latent dim ", ckv.size(2),
             " does not match q_nope's ", q.size(2));
  ASTR_CHECK(krope.size(0) == ckv.size(0) && krope.size(1) == ckv.size(1), "krope_cache: shape ",
             krope.sizes(), " does not match ckv_cache's ", ckv.sizes(), " in pages and page_size");
  ASTR_CHECK(krope.size(2) == a.q_rope.size(2), "krope_cache: rope dim ", krope.size(2),
             " does not match q_rope's ", a.q_rope.size(2));
  if (!fp8) {
    ASTR_CHECK_VALUE(!a.ckv_scale, "ckv_scale: only for an FP8 latent cache (ckv_cache holds ",
                     ckv.scalar_type(), ")");
    return;
  }
  ASTR_CHECK_VALUE(a.ckv_scale.has_value(), "ckv_scale: an FP8 latent cache (", ckv.scalar_type(),
                   ") needs its float32 [1] scale (PagedLatentCache.ckv_scales[layer])");
  const at::Tensor& scale = *a.ckv_scale;
  ASTR_CHECK_VALUE(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == 1,
                   "ckv_scale: expected a float32 tensor of shape [1], got ", scale.scalar_type(),
                   " of shape ", scale.sizes());
  check_on_device_of_q(q, scale, "ckv_scale");
  // Its value (0, negative, NaN or inf reads every latent wrong), where reading it costs no
  // synchronisation: a CPU tensor, or the checked mode.
  if (has_readable_values(scale) && (scale.device().is_cpu() || metadata_checks_enabled())) {
    check_positive_finite_scale(scale, "ckv_scale");
  }
}

void validate_metadata(const MlaAttentionArgs& a) {
  const at::Tensor& q = a.q_nope;
  check_metadata(q, a.block_table, "block_table", 2, "[batch, pages_per_seq]");
  check_metadata(q, a.seq_lens, "seq_lens", 1, "[batch]");
  check_metadata(q, a.query_start_loc, "query_start_loc", 1, "[batch + 1]");
  const int64_t batch = a.seq_lens.size(0);
  ASTR_CHECK(a.block_table.size(0) == batch, "block_table: has ", a.block_table.size(0),
             " rows, expected one per sequence (", batch, ", from seq_lens)");
  ASTR_CHECK(a.block_table.size(1) >= 1, "block_table: expected at least one page column ",
             "[batch, pages_per_seq >= 1], got shape ", a.block_table.sizes());
  ASTR_CHECK(a.query_start_loc.size(0) == batch + 1, "query_start_loc: has ",
             a.query_start_loc.size(0), " entries, expected batch + 1 = ", batch + 1);
  ASTR_CHECK(batch > 0 || q.sym_size(0) == 0,
             "q_nope: query tokens given, but the batch has no sequences (seq_lens is empty)");
  if (a.decode()) {
    ASTR_CHECK(q.size(0) == batch, "q_nope: decode takes one token per sequence: expected ", batch,
               " tokens (from seq_lens), got ", q.size(0));
  } else {
    ASTR_CHECK(a.max_query_len >= 1, "max_query_len: required for a prefill: the largest ",
               "number of new tokens of any sequence (a host int, so no op reads lengths back)");
  }
  check_paged_metadata_values({a.block_table, a.seq_lens, &a.query_start_loc, q.size(0),
                               a.max_query_len, a.decode(), a.ckv_cache.size(0),
                               a.ckv_cache.size(1), "q_nope"});
}

}  // namespace

MlaAttentionArgs::MlaAttentionArgs(const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS,
                                   bool return_lse)
    : q_nope(q_nope)
#define ASTR_MLA_INIT(name, type, default_value, cpp_type) , name(name)
          ASTR_MLA_ATTENTION_ARGS(ASTR_MLA_INIT)
#undef ASTR_MLA_INIT
      ,
      return_lse(return_lse),
      call_mode(parse_mla_mode(mode)) {
}

CallDescription validate_and_describe_mla(const MlaAttentionArgs& a) {
  validate_queries(a);
  validate_pools(a);
  validate_metadata(a);
  const at::Tensor& q = a.q_nope;
  CallDescription call;
  call.latent = true;
  call.dtype = scalar_type_of(q.scalar_type());
  call.device = q.device().is_cpu()    ? DeviceKind::kCPU
                : q.device().is_cuda() ? DeviceKind::kCUDA
                                       : DeviceKind::kOther;
  call.arch = call.device == DeviceKind::kCUDA ? cuda_device_arch(q.get_device()) : 0;
  call.q_rank = 3;
  call.head_dim = static_cast<int>(a.latent_dim() + a.rope_dim());
  call.head_dim_v = static_cast<int>(a.latent_dim());
  call.num_q_heads = static_cast<int>(q.size(1));
  call.num_kv_heads = 1;
  call.has_kv_cache = true;
  call.page_size = static_cast<int>(a.ckv_cache.size(1));
  const std::pair<const at::Tensor*, const char*> tensors[] = {{&q, "q_nope"},
                                                               {&a.q_rope, "q_rope"},
                                                               {&a.ckv_cache, "ckv_cache"},
                                                               {&a.krope_cache, "krope_cache"}};
  for (auto [t, name] : tensors) {
    call.cuda_layout = cuda_layout_problem(*t, name);
    if (!call.cuda_layout.empty()) break;
  }
  call.mode = a.call_mode;
  call.needs_grad = any_requires_grad(a);
  call.is_causal = a.is_causal;
  call.lse = a.return_lse;
  call.kv_dtype = scalar_type_of(a.ckv_cache.scalar_type());
  call.kv_scales = a.ckv_scale.has_value();
  return call;
}

}  // namespace astr
