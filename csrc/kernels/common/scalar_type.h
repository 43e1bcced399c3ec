// The element types astrai names, torch-free: the kernels' parameter structs, the resolver's
// call description and the bindings share this one list (support/torch_scalar_type.h maps torch's
// dtypes onto it).
#pragma once

namespace astr {

//   X(enumerator, name as torch prints it, bytes per element)
#define ASTR_SCALAR_TYPES(X)         \
  X(kFloat16, "float16", 2)          \
  X(kBFloat16, "bfloat16", 2)        \
  X(kFloat32, "float32", 4)          \
  X(kFloat8E4M3, "float8_e4m3fn", 1) \
  X(kFloat8E5M2, "float8_e5m2", 1)   \
  X(kFloat64, "float64", 8)          \
  X(kOther, "other", 0)

enum class ScalarType : int {
#define ASTR_SCALAR_TYPE_ENUMERATOR(enumerator, name, bytes) enumerator,
  ASTR_SCALAR_TYPES(ASTR_SCALAR_TYPE_ENUMERATOR)
#undef ASTR_SCALAR_TYPE_ENUMERATOR
};

constexpr int element_bytes(ScalarType type) {
  switch (type) {
#define ASTR_SCALAR_TYPE_BYTES(enumerator, name, bytes) \
  case ScalarType::enumerator:                          \
    return bytes;
    ASTR_SCALAR_TYPES(ASTR_SCALAR_TYPE_BYTES)
#undef ASTR_SCALAR_TYPE_BYTES
  }
  return 0;
}

constexpr const char* scalar_type_name(ScalarType type) {
  switch (type) {
#define ASTR_SCALAR_TYPE_NAME(enumerator, name, bytes) \
  case ScalarType::enumerator:                         \
    return name;
    ASTR_SCALAR_TYPES(ASTR_SCALAR_TYPE_NAME)
#undef ASTR_SCALAR_TYPE_NAME
  }
  return "other";
}

constexpr bool is_fp8(ScalarType type) {
  return type == ScalarType::kFloat8E4M3 || type == ScalarType::kFloat8E5M2;
}

constexpr bool is_half_precision(ScalarType type) {
  return type == ScalarType::kFloat16 || type == ScalarType::kBFloat16;
}

}  // namespace astr
