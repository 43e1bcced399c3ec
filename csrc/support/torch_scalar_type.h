// torch's dtypes as astrai's one torch-free ScalarType (kernels/common/scalar_type.h).
#pragma once

#include <c10/core/ScalarType.h>

#include "kernels/common/scalar_type.h"

namespace astr {

inline ScalarType scalar_type_of(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Half:
      return ScalarType::kFloat16;
    case c10::ScalarType::BFloat16:
      return ScalarType::kBFloat16;
    case c10::ScalarType::Float:
      return ScalarType::kFloat32;
    case c10::ScalarType::Double:
      return ScalarType::kFloat64;
    case c10::ScalarType::Float8_e4m3fn:
      return ScalarType::kFloat8E4M3;
    case c10::ScalarType::Float8_e5m2:
      return ScalarType::kFloat8E5M2;
    default:
      return ScalarType::kOther;
  }
}

inline bool is_fp8(c10::ScalarType type) { return is_fp8(scalar_type_of(type)); }

}  // namespace astr
