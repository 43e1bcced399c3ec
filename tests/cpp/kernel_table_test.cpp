// csrc/README.md's table "Which kernel runs a call", walked row by row through the plan: the
// table is what the plan does, or this test fails. Rows name a GPU (an H100 for sm_90 with a
// library built for sm_90a, an A100 for sm_80), head dims, the call kind, the cache, a decode
// batch (Hq 32 and Hkv 8 unless the row says otherwise) and the form the plan picks.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "config.h"
#include "plan.h"

namespace {

using astr::kernels::DecodePlan;
using astr::kernels::DecodeShape;
using astr::kernels::DeviceFacts;
using astr::kernels::KernelTuning;
using astr::kernels::kFp8ScratchLimitBytes;
using astr::kernels::PrefillPlan;

constexpr char kBegin[] = "<!-- kernel table begin -->";
constexpr char kEnd[] = "<!-- kernel table end -->";

struct Row {
  std::string text;  // the row as written, for failure messages
  std::string gpu, head_dims, call, cache, batch, form;
};

std::string trim(const std::string& text) {
  const size_t first = text.find_first_not_of(" `");
  if (first == std::string::npos) return "";
  const size_t last = text.find_last_not_of(" `");
  return text.substr(first, last - first + 1);
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, separator)) parts.push_back(trim(part));
  return parts;
}

// The table's body rows (after its header and separator lines).
std::vector<Row> table_rows() {
  std::ifstream file(ASTR_CSRC_README);
  std::string line;
  bool inside = false;
  int header_lines = 0;
  std::vector<Row> rows;
  while (std::getline(file, line)) {
    if (line.find(kBegin) != std::string::npos) {
      inside = true;
      continue;
    }
    if (line.find(kEnd) != std::string::npos) break;
    if (!inside || line.rfind("|", 0) != 0) continue;
    if (header_lines < 2) {
      ++header_lines;
      continue;
    }
    std::vector<std::string> cells = split(line.substr(1, line.rfind('|') - 1), '|');
    EXPECT_EQ(cells.size(), 6u) << line;
    if (cells.size() != 6) continue;
    rows.push_back({line, cells[0], cells[1], cells[2], cells[3], cells[4], cells[5]});
  }
  return rows;
}

DeviceFacts device_of(const std::string& gpu) {
  DeviceFacts facts;
  if (gpu.find("sm_90") != std::string::npos) {
    facts.arch = 90;
    facts.num_sms = 132;
    facts.max_smem_per_block = 227 * 1024;
    facts.max_smem_per_sm = 228 * 1024;
    facts.l2_cache_bytes = int64_t{50} << 20;
    facts.has_sm90a_code = true;
  } else {
    EXPECT_NE(gpu.find("sm_80"), std::string::npos) << "GPU column: " << gpu;
    facts.arch = 80;
    facts.num_sms = 108;
    facts.max_smem_per_block = 163 * 1024;
    facts.max_smem_per_sm = 164 * 1024;
    facts.l2_cache_bytes = int64_t{40} << 20;
  }
  return facts;
}

// "B=16 L=4096 Hkv=32": L is the block table's width in positions.
DecodeShape decode_shape(const std::string& batch, int head_dim, bool fp8) {
  DecodeShape shape;
  shape.num_q_heads = 32;
  shape.num_kv_heads = 8;
  shape.head_dim = head_dim;
  shape.kv_bytes = fp8 ? 1 : 2;
  for (const std::string& item : split(batch, ' ')) {
    const size_t equals = item.find('=');
    if (item.empty() || equals == std::string::npos) continue;
    const std::string key = item.substr(0, equals);
    const int64_t value = std::stoll(item.substr(equals + 1));
    if (key == "B") shape.num_seqs = static_cast<int>(value);
    if (key == "L") shape.block_table_positions = value;
    if (key == "Hq") shape.num_q_heads = static_cast<int>(value);
    if (key == "Hkv") shape.num_kv_heads = static_cast<int>(value);
  }
  return shape;
}

// What the plan picks, written as the table's form column writes it.
std::string planned_form(const Row& row, int head_dim) {
  const DeviceFacts device = device_of(row.gpu);
  const bool fp8 = row.cache.rfind("FP8", 0) == 0;
  if (row.call == "decode") {
    const DecodePlan plan =
        astr::kernels::plan_paged_decode(decode_shape(row.batch, head_dim, fp8), device, {});
    if (!plan.error.empty()) return plan.error;
    return astr::kernels::describe_plan(plan);
  }
  EXPECT_EQ(row.call, "prefill") << row.text;
  std::optional<int64_t> scratch;
  if (fp8) {
    const bool past_limit = row.cache.find("past the scratch limit") != std::string::npos;
    scratch = past_limit ? kFp8ScratchLimitBytes + 1 : kFp8ScratchLimitBytes;
  }
  const PrefillPlan plan =
      astr::kernels::plan_paged_prefill(head_dim, device, KernelTuning{}, scratch);
  if (!plan.error.empty()) return plan.error;
  return astr::kernels::describe_plan(plan, fp8);
}

TEST(KernelTable, EveryRowIsWhatThePlanPicks) {
  const std::vector<Row> rows = table_rows();
  ASSERT_GE(rows.size(), 10u) << "no table between " << kBegin << " and " << kEnd << " in "
                              << ASTR_CSRC_README;
  for (const Row& row : rows) {
    for (const std::string& head_dim : split(row.head_dims, ',')) {
      EXPECT_EQ(planned_form(row, std::stoi(head_dim)), row.form)
          << "head dim " << head_dim << " of the row\n  " << row.text;
    }
  }
}

// Every head dim the kernels are built for appears in the table, for prefill and for decode.
TEST(KernelTable, CoversEveryHeadDimAndCallKind) {
  const std::vector<Row> rows = table_rows();
  for (const auto& forms : astr::kernels::kPagedHeadDims) {
    for (const std::string call : {"prefill", "decode"}) {
      bool found = false;
      for (const Row& row : rows) {
        for (const std::string& head_dim : split(row.head_dims, ','))
          found |= row.call == call && std::stoi(head_dim) == forms.head_dim;
      }
      EXPECT_TRUE(found) << call << " at head dim " << forms.head_dim << " has no row";
    }
  }
}

}  // namespace
