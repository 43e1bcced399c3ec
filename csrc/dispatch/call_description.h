// A small, torch-free description of one attention call: everything the resolver's capability
// rules look at. The adapter in csrc/describe_call.cpp fills it from tensors; GoogleTest fills it
// by hand.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace astr::dispatch {

// Priority order is the enum order: cuda > flash > torch_native.
enum class Backend : int { kCuda = 0, kFlash = 1, kTorchNative = 2 };
constexpr int kNumBackends = 3;
constexpr Backend kAllBackends[kNumBackends] = {Backend::kCuda, Backend::kFlash,
                                                Backend::kTorchNative};

const char* backend_name(Backend backend);
// "cuda", "flash", "torch_native" -> the backend; anything else -> nullopt.
std::optional<Backend> parse_backend(std::string_view name);
// "cuda, flash, torch_native": for error messages.
std::string valid_backend_names();

enum class ScalarKind { kFloat16, kBFloat16, kFloat32, kFloat64, kOther };
enum class DeviceKind { kCPU, kCUDA, kOther };
enum class MaskForm { kNone, kBoolean, kAdditive };
// kTraining: fwd=None, no cache, may need gradients. kPrefill / kDecode: inference calls; with a
// KV cache they read the paged pool, without one they are dense calls.
enum class Mode { kTraining, kPrefill, kDecode };

const char* scalar_kind_name(ScalarKind kind);
const char* device_kind_name(DeviceKind kind);
const char* mode_name(Mode mode);

struct CallDescription {
  ScalarKind dtype = ScalarKind::kBFloat16;
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
  // Dense calls only: false when q_len != kv_len, where causal alignment conventions differ.
  bool q_len_equals_kv_len = true;
  // Paged calls: why q or the cache pools cannot feed the cuda kernels' 16-byte copies and
  // 32-bit in-page offsets (see cuda_layout_problem in csrc/describe_call.cpp); "" when they can.
  std::string cuda_layout;
};

}  // namespace astr::dispatch
