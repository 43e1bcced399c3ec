// Element types the kernels read and write, as the bindings name them (torch-free).
#pragma once

namespace astrai::kernels {

enum class ScalarType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

constexpr int element_bytes(ScalarType type) {
  switch (type) {
    case ScalarType::kFloat16:
    case ScalarType::kBFloat16:
      return 2;
    case ScalarType::kFloat32:
      return 4;
  }
  return 0;
}

}  // namespace astrai::kernels
