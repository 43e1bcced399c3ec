// Element types the kernels read and write, as the bindings name them (torch-free).
#pragma once

namespace astr::kernels {

enum class ScalarType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat8E4M3 = 3,  // torch.float8_e4m3fn
  kFloat8E5M2 = 4,  // torch.float8_e5m2
};

constexpr int element_bytes(ScalarType type) {
  switch (type) {
    case ScalarType::kFloat16:
    case ScalarType::kBFloat16:
      return 2;
    case ScalarType::kFloat32:
      return 4;
    case ScalarType::kFloat8E4M3:
    case ScalarType::kFloat8E5M2:
      return 1;
  }
  return 0;
}

constexpr bool is_fp8(ScalarType type) {
  return type == ScalarType::kFloat8E4M3 || type == ScalarType::kFloat8E5M2;
}

}  // namespace astr::kernels
