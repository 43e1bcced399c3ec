#include "backend_status.h"

namespace astr::dispatch {

std::string json_escape(const std::string& text) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (byte < 0x20 || byte == 0x7f) {
      out += "\\u00";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xf];
    } else {
      out += c;  // bytes of UTF-8 sequences pass through
    }
  }
  return out;
}

std::string BackendStatus::to_json() const {
  std::string json = "{\"available\": ";
  json += available ? "true" : "false";
  json += ", \"reason\": \"";
  json += json_escape(reason);
  json += "\", \"version\": ";
  json += std::to_string(version);
  json += "}";
  return json;
}

BackendStatusTable& BackendStatusTable::instance() {
  static BackendStatusTable table;
  return table;
}

BackendStatusTable::BackendStatusTable() {
#define ASTR_BACKEND_STATUS(enumerator, name, available, reason, aliases) \
  status_[static_cast<int>(Backend::enumerator)] = {available, reason, 0};
  ASTR_BACKENDS(ASTR_BACKEND_STATUS)
#undef ASTR_BACKEND_STATUS
}

BackendStatus BackendStatusTable::get(Backend backend) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return status_[static_cast<int>(backend)];
}

std::array<BackendStatus, kNumBackends> BackendStatusTable::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::array<BackendStatus, kNumBackends> copy;
  for (int i = 0; i < kNumBackends; ++i) copy[i] = status_[i];
  return copy;
}

void BackendStatusTable::set(Backend backend, BackendStatus status) {
  std::lock_guard<std::mutex> lock(mutex_);
  status_[static_cast<int>(backend)] = std::move(status);
  generation_.fetch_add(1, std::memory_order_release);
}

}  // namespace astr::dispatch
