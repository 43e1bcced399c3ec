// ASTR_CHECK: TORCH_CHECK with the message built here, to one std::string, before it reaches c10.
//
// Why: on the H200 image (torch 2.11+cu130, GCC 13) a TORCH_CHECK whose message streamed an
// integer through c10::str crashed the process (SIGSEGV) instead of raising, while messages made
// only of strings raised cleanly. Numbers are therefore formatted with std::to_string and
// shapes/dtypes/devices by their own to-string.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace astr::detail {

inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, char c) { out += c; }
inline void append(std::string& out, c10::ScalarType type) { out += c10::toString(type); }
inline void append(std::string& out, const c10::Device& device) { out += device.str(); }
inline void append(std::string& out, c10::IntArrayRef values) {
  out += '[';
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  out += ']';
}
template <typename T>
std::enable_if_t<std::is_arithmetic_v<T>> append(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

}  // namespace astr::detail

namespace astr {

// "7", or "?" for a size only known symbolically (while torch.compile traces).
inline std::string size_string(const c10::SymInt& size) {
  const auto value = size.maybe_as_int();
  return value ? std::to_string(*value) : std::string("?");
}

// "[3, 2, 16]", with "?" for each size only known symbolically.
inline std::string sizes_string(const at::Tensor& t) {
  std::string text = "[";
  const auto sizes = t.sym_sizes();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (d) text += ", ";
    text += size_string(sizes[d]);
  }
  return text + "]";
}

}  // namespace astr

#define ASTR_CHECK(cond, ...)                                   \
  do {                                                          \
    if (C10_UNLIKELY(!(cond))) {                                \
      TORCH_CHECK(false, ::astr::detail::message(__VA_ARGS__)); \
    }                                                           \
  } while (false)

#define ASTR_CHECK_VALUE(cond, ...)                                   \
  do {                                                                \
    if (C10_UNLIKELY(!(cond))) {                                      \
      TORCH_CHECK_VALUE(false, ::astr::detail::message(__VA_ARGS__)); \
    }                                                                 \
  } while (false)
