// How this library was built, recorded by setup.py as macros; and the cuda backend's
// process-wide status, which depends only on the build.
#include <algorithm>
#include <string>

#include "dispatch/backend_status.h"
#include "dispatch/call_description.h"
#include "kernels/paged_attention/config.h"
#include "ops/ops.h"

#ifndef ASTR_TORCH_VERSION
#define ASTR_TORCH_VERSION "unknown"
#endif
#ifndef ASTR_CUDA_VERSION
#define ASTR_CUDA_VERSION ""
#endif
#ifndef ASTR_CUDA_ARCHS
#define ASTR_CUDA_ARCHS ""
#endif
// The commit built (setup.py writes this header into build/generated/ on every build; only this
// file includes it, so a new commit rebuilds only this file).
#if __has_include("astrai_build_commit.h")
#include "astrai_build_commit.h"
#endif
#ifndef ASTR_GIT_COMMIT
#define ASTR_GIT_COMMIT ""
#endif

namespace astr {

namespace {

bool built_with_cuda() {
#ifdef ASTR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// Runs when the library is loaded.
const bool cuda_status_recorded = [] {
  if (built_with_cuda()) {
    dispatch::BackendStatusTable::instance().set(
        dispatch::Backend::kCuda, {true, std::string("kernels built for ") + ASTR_CUDA_ARCHS, 0});
  }
  return true;
}();

}  // namespace

namespace {

// What the cuda kernels were built for (config.h's list, less what a development build left
// out), for `info` and the tests: {"head_dims": [...], "head_dim_pairs": [[D, Dv], ...],
// "q_dtypes": [...], "forms": {"D" or "D/Dv": [...]}}. head_dims lists the rows of equal q/k and
// v head dims; head_dim_pairs every row.
std::string kernel_list_json() {
  using astr::kernels::HeadDimForms;
  std::string dims, pairs, forms;
  for (const HeadDimForms& row : astr::kernels::kPagedHeadDims) {
    if (!astr::kernels::paged_head_dim_built(row.head_dim)) continue;
    const std::string d = astr::kernels::paged_head_dim_text(row);  // "128", "192/128"
    if (row.head_dim == row.head_dim_v)
      dims += (dims.empty() ? "" : ", ") + std::to_string(row.head_dim);
    pairs += std::string(pairs.empty() ? "" : ", ") + "[" + std::to_string(row.head_dim) + ", " +
             std::to_string(row.head_dim_v) + "]";
    if (!forms.empty()) forms += ", ";
    std::string list = "\"decode_split\", \"decode_cluster\", \"prefill_mma_sync\"";
    if (row.decode_block_pairs) list += ", \"decode_block_pairs\"";
    if (row.decode_eight_warps) list += ", \"decode_eight_warps\"";
    if (row.decode_persistent) list += ", \"decode_persistent\"";
    if (row.prefill_wgmma) list += ", \"prefill_wgmma\"";
    if (row.prefill_warp_specialized) list += ", \"prefill_warp_specialized\"";
    if (row.prefill_persistent) list += ", \"prefill_persistent\"";
    if (row.topk) list += ", \"topk\"";
    forms += "\"" + d + "\": [" + list + "]";
  }
  std::string q_dtypes;
#define ASTR_Q_DTYPE_NAME(enumerator, type, name) \
  q_dtypes += std::string(q_dtypes.empty() ? "" : ", ") + "\"" + name + "\"";
  ASTR_PAGED_Q_TYPES(ASTR_Q_DTYPE_NAME)
#undef ASTR_Q_DTYPE_NAME
  return "{\"head_dims\": [" + dims + "], \"head_dim_pairs\": [" + pairs + "], \"q_dtypes\": [" +
         q_dtypes + "], \"forms\": {" + forms + "}}";
}

// Which backends implement each variant (call_description.h: ASTR_VARIANTS), for `info`:
// {"window_left": {"cuda": true, "flash": true, "torch_native": true}, ...}.
std::string variants_json() {
  std::string json;
#define ASTR_VARIANT_JSON(field, argument, cuda, flash, torch_native) \
  json += std::string(json.empty() ? "" : ", ") + "\"" + argument +   \
          "\": {\"cuda\": " + (cuda ? "true" : "false") +             \
          ", \"flash\": " + (flash ? "true" : "false") +              \
          ", \"torch_native\": " + (torch_native ? "true" : "false") + "}";
  ASTR_VARIANTS(ASTR_VARIANT_JSON)
#undef ASTR_VARIANT_JSON
  return "{" + json + "}";
}

// The built-in backends in priority order, each with its other names (call_description.h:
// ASTR_BACKENDS), for Python's names: {"cuda": [], "flash": [], "torch_native": ["sdpa"]}.
std::string backends_json() {
  std::string json;
  for (dispatch::Backend backend : dispatch::kAllBackends) {
    if (!json.empty()) json += ", ";
    json += std::string("\"") + dispatch::backend_name(backend) + "\": [";
    std::string aliases = dispatch::backend_aliases(backend);
    for (size_t start = 0; !aliases.empty() && start <= aliases.size();) {
      const size_t comma = std::min(aliases.find(',', start), aliases.size());
      if (start) json += ", ";
      json += "\"" + aliases.substr(start, comma - start) + "\"";
      start = comma + 1;
    }
    json += "]";
  }
  return "{" + json + "}";
}

}  // namespace

std::string build_info() {
  return std::string("{\"torch_version\": \"") + ASTR_TORCH_VERSION +
         "\", \"with_cuda\": " + (built_with_cuda() ? "true" : "false") + ", \"cuda_version\": \"" +
         ASTR_CUDA_VERSION + "\", \"cuda_archs\": \"" + ASTR_CUDA_ARCHS + "\", \"git_commit\": \"" +
         ASTR_GIT_COMMIT + "\", \"backends\": " + backends_json() +
         ", \"paged_kernels\": " + kernel_list_json() + ", \"variants\": " + variants_json() + "}";
}

}  // namespace astr
