// A small, torch-free description of one attention call: everything the resolver's capability
// rules look at. The adapter in csrc/describe_call.cpp fills it from tensors; GoogleTest fills it
// by hand.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "../kernels/common/scalar_type.h"

namespace astr::dispatch {

// The one list of built-in backends, in default priority order (cuda > flash > torch_native):
//   X(enumerator, name, available at load, reason while unavailable, other names)
// Everything else derives from it: the enum, names, the status table's first state, the
// capability rules' table (capability.cpp: one rules function per backend, named <name>_rules)
// and, through build_info, Python's names (attn_backend("sdpa"), ASTR_BACKEND=sdpa). Other names
// (comma-separated) are accepted wherever a backend is named and stand for the backend's name.
// Adding a backend: csrc/README.md.
#define ASTR_BACKENDS(X)                                                                         \
  X(kCuda, cuda, false, "library built without CUDA kernels", "")                                \
  X(kFlash, flash, false, "flash-attn not probed yet (astrai.extension probes it on first use)", \
    "")                                                                                          \
  X(kTorchNative, torch_native, true, "", "sdpa")

enum class Backend : int {
#define ASTR_BACKEND_ENUMERATOR(enumerator, name, available, reason, aliases) enumerator,
  ASTR_BACKENDS(ASTR_BACKEND_ENUMERATOR)
#undef ASTR_BACKEND_ENUMERATOR
};
constexpr Backend kAllBackends[] = {
#define ASTR_BACKEND_VALUE(enumerator, name, available, reason, aliases) Backend::enumerator,
    ASTR_BACKENDS(ASTR_BACKEND_VALUE)
#undef ASTR_BACKEND_VALUE
};
constexpr int kNumBackends = sizeof(kAllBackends) / sizeof(kAllBackends[0]);

const char* backend_name(Backend backend);
// The backend's other names, comma-separated ("sdpa" for torch_native; "" for none).
const char* backend_aliases(Backend backend);
// "cuda", "flash", "torch_native" or another name of one ("sdpa") -> the backend; anything else
// -> nullopt.
std::optional<Backend> parse_backend(std::string_view name);
// "cuda, flash, torch_native (or sdpa)": for error messages.
std::string valid_backend_names();

// The variants a call may ask for (kernels/paged_attention/params.h defines them), and which
// backends implement each; the capability rules pass a backend by for a variant it lacks, and a
// backend's own op refuses it (validate_variant_args). One column per backend, in ASTR_BACKENDS'
// order:
//   X(CallDescription field, the op's argument, cuda, flash, torch_native)
#define ASTR_VARIANTS(X)                     \
  X(window, "window_left", true, true, true) \
  X(softcap, "softcap", true, true, true)    \
  X(sinks, "sinks", true, false, true)       \
  X(lse, "return_lse", true, true, true)     \
  X(topk, "topk_indices", true, false, true) \
  X(tree_mask, "tree_mask", true, false, true)

enum class DeviceKind { kCPU, kCUDA, kOther };
enum class MaskForm { kNone, kBoolean, kAdditive };
// kTraining: fwd=None, no cache, may need gradients. kPrefill / kDecode: inference calls; with a
// KV cache they read the paged pool, without one they are dense calls.
enum class Mode { kTraining, kPrefill, kDecode };

const char* device_kind_name(DeviceKind kind);
const char* mode_name(Mode mode);

struct CallDescription {
  ScalarType dtype = ScalarType::kBFloat16;
  DeviceKind device = DeviceKind::kCPU;
  int arch = 0;  // CUDA compute capability as major*10+minor (90 = sm_90); 0 off the GPU.
  int q_rank = 4;
  int head_dim = 0;    // of q and k
  int head_dim_v = 0;  // of v
  int num_q_heads = 0;
  int num_kv_heads = 0;
  bool has_kv_cache = false;
  int page_size = 0;  // 0 without a cache
  MaskForm mask = MaskForm::kNone;
  Mode mode = Mode::kTraining;
  bool needs_grad = false;
  bool is_causal = false;
  // floor(log2(max_query_len)) (paged) or of q's length (dense): the length class of the measured
  // preference table (preferences.h); 0 for a length of 1 or less.
  int query_len_log2 = 0;
  // Dense calls only: false when q_len != kv_len, where causal alignment conventions differ.
  bool q_len_equals_kv_len = true;
  // Paged calls: why q or the cache pools cannot feed the cuda kernels' 16-byte copies and
  // 32-bit in-page offsets (see cuda_layout_problem in csrc/describe_call.cpp); "" when they can.
  std::string cuda_layout;
  // The variants asked for (ASTR_VARIANTS), and the cache's element type.
#define ASTR_VARIANT_FIELD(field, argument, cuda, flash, torch_native) bool field = false;
  ASTR_VARIANTS(ASTR_VARIANT_FIELD)
#undef ASTR_VARIANT_FIELD
  // topk_indices' entries per query row (its last dim): 0 without, -1 where symbolic.
  int64_t topk_entries = 0;
  ScalarType kv_dtype = ScalarType::kOther;  // of the cache (paged) or k (dense)
  bool kv_scales = false;                    // k_scale / v_scale given
  // astr::mla_attention: latent attention over a paged latent cache. q/k are [latent | rope]
  // (head_dim = Dc + Dr, of which head_dim_v = Dc is the latent, also the value), one kv head
  // shared by every q head; kv_dtype is the latent's.
  bool latent = false;
};

}  // namespace astr::dispatch
