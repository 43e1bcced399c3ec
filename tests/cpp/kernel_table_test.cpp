// csrc/README.md's tables "Which kernel runs a call" (the default mode, and batch-invariant
// mode), walked row by row through the plan: the tables are what the plan does, or this test
// fails. Rows name a GPU (an H100 for sm_90 with a library built for sm_90a, an A100 for sm_80),
// head dims ("128", or "192/128" for q/k head dim 192 and v head dim 128), the call kind (prefill,
// decode, verify: a prefill-mode call of Q new tokens per sequence, or topk: a call with
// topk_indices, T query tokens of K entries), the cache, a decode, verify or top-k batch (Hq 32
// and Hkv 8 unless the row says otherwise) and the form the plan picks. The table of opt-in forms
// has the kernel tuning that selects them where the others have the batch.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "config.h"
#include "device_facts.h"
#include "plan.h"

namespace {

using astr::kernels::DecodePlan;
using astr::kernels::DecodeShape;
using astr::kernels::DeviceFacts;
using astr::kernels::KernelTuning;
using astr::kernels::kFp8ScratchLimitBytes;
using astr::kernels::PrefillPlan;
using astr::kernels::TopkShape;
using astr::kernels::testing::sm80_facts;
using astr::kernels::testing::sm90_facts;

constexpr char kBegin[] = "<!-- kernel table begin -->";
constexpr char kEnd[] = "<!-- kernel table end -->";
constexpr char kInvariantBegin[] = "<!-- batch-invariant kernel table begin -->";
constexpr char kInvariantEnd[] = "<!-- batch-invariant kernel table end -->";
constexpr char kOptInBegin[] = "<!-- opt-in kernel table begin -->";
constexpr char kOptInEnd[] = "<!-- opt-in kernel table end -->";

struct Row {
  std::string text;                                      // the row as written, for failure messages
  std::string gpu, head_dims, call, cache, batch, form;  // batch: the tuning, opt-in rows
  bool batch_invariant;                                  // a row of the batch-invariant table
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

// The body rows (after its header and separator lines) of the table between begin and end.
std::vector<Row> rows_between(const char* begin, const char* end, bool batch_invariant) {
  std::ifstream file(ASTR_CSRC_README);
  std::string line;
  bool inside = false;
  int header_lines = 0;
  std::vector<Row> rows;
  while (std::getline(file, line)) {
    if (line.find(begin) != std::string::npos) {
      inside = true;
      continue;
    }
    if (inside && line.find(end) != std::string::npos) break;
    if (!inside || line.rfind("|", 0) != 0) continue;
    if (header_lines < 2) {
      ++header_lines;
      continue;
    }
    std::vector<std::string> cells = split(line.substr(1, line.rfind('|') - 1), '|');
    EXPECT_EQ(cells.size(), 6u) << line;
    if (cells.size() != 6) continue;
    rows.push_back(
        {line, cells[0], cells[1], cells[2], cells[3], cells[4], cells[5], batch_invariant});
  }
  return rows;
}
// The default table or the batch-invariant one.
std::vector<Row> table_rows(bool batch_invariant) {
  return batch_invariant ? rows_between(kInvariantBegin, kInvariantEnd, true)
                         : rows_between(kBegin, kEnd, false);
}

DeviceFacts device_of(const std::string& gpu) {
  if (gpu.find("sm_90") != std::string::npos) {
    DeviceFacts facts = sm90_facts();
    facts.l2_cache_bytes = int64_t{50} << 20;
    return facts;
  }
  EXPECT_NE(gpu.find("sm_80"), std::string::npos) << "GPU column: " << gpu;
  DeviceFacts facts = sm80_facts();
  facts.l2_cache_bytes = int64_t{40} << 20;
  return facts;
}

// A head-dim cell's entry: "128" (q/k and v), or "192/128" (q/k, then v).
struct HeadDims {
  int qk, v;
};
HeadDims parse_head_dims(const std::string& text) {
  const size_t slash = text.find('/');
  if (slash == std::string::npos) return {std::stoi(text), std::stoi(text)};
  return {std::stoi(text.substr(0, slash)), std::stoi(text.substr(slash + 1))};
}

// A batch column's "KEY=VALUE" items ("B=16 L=4096"), in order.
std::vector<std::pair<std::string, int64_t>> batch_items(const std::string& batch) {
  std::vector<std::pair<std::string, int64_t>> items;
  for (const std::string& item : split(batch, ' ')) {
    const size_t equals = item.find('=');
    if (item.empty() || equals == std::string::npos) continue;
    items.emplace_back(item.substr(0, equals), std::stoll(item.substr(equals + 1)));
  }
  return items;
}

// What a decode and a top-k row share: GQA 32/8 unless the row says "Hq=" or "Hkv=", the head
// dims of the column and the cache's element size.
template <typename Shape>
Shape table_shape(const std::string& batch, HeadDims head_dims, bool fp8) {
  Shape shape;
  shape.num_q_heads = 32;
  shape.num_kv_heads = 8;
  shape.head_dim = head_dims.qk;
  shape.head_dim_v = head_dims.v;
  shape.kv_bytes = fp8 ? 1 : 2;
  for (const auto& [key, value] : batch_items(batch)) {
    if (key == "Hq") shape.num_q_heads = static_cast<int>(value);
    if (key == "Hkv") shape.num_kv_heads = static_cast<int>(value);
  }
  return shape;
}

// "B=16 L=4096 Hkv=32 Q=8": L is the block table's width in positions, Q a verify's new tokens
// per sequence (its max_query_len).
DecodeShape decode_shape(const std::string& batch, HeadDims head_dims, bool fp8) {
  DecodeShape shape = table_shape<DecodeShape>(batch, head_dims, fp8);
  for (const auto& [key, value] : batch_items(batch)) {
    if (key == "B") shape.num_seqs = static_cast<int>(value);
    if (key == "L") shape.block_table_positions = value;
    if (key == "Q") shape.query_len = static_cast<int>(value);
  }
  if (shape.query_len > 0)
    shape.num_tokens = static_cast<int64_t>(shape.num_seqs) * shape.query_len;
  return shape;
}

// "T=1 K=2048 Hkv=8": T query tokens of a top-k call, K entries each.
TopkShape topk_shape(const std::string& batch, HeadDims head_dims, bool fp8) {
  TopkShape shape = table_shape<TopkShape>(batch, head_dims, fp8);
  for (const auto& [key, value] : batch_items(batch)) {
    if (key == "T") shape.num_tokens = value;
    if (key == "K") shape.topk = value;
  }
  return shape;
}

std::string decode_form(const DecodePlan& plan) {
  if (!plan.error.empty()) return plan.error;
  return astr::kernels::describe_plan(plan);
}

// What the plan picks, written as the table's form column writes it; tuning: the opt-in table's.
std::string planned_form(const Row& row, HeadDims head_dims, const KernelTuning& tuning = {}) {
  const DeviceFacts device = device_of(row.gpu);
  const bool fp8 = row.cache.rfind("FP8", 0) == 0;
  if (row.call == "topk") {
    TopkShape shape = topk_shape(row.batch, head_dims, fp8);
    EXPECT_GT(shape.num_tokens, 0) << "a top-k row names its T and K: " << row.text;
    shape.batch_invariant = row.batch_invariant;
    const astr::kernels::TopkPlan plan = astr::kernels::plan_paged_topk(shape, device, {});
    return plan.error.empty() ? astr::kernels::describe_plan(plan) : plan.error;
  }
  DecodeShape shape = decode_shape(row.batch, head_dims, fp8);
  shape.batch_invariant = row.batch_invariant;
  if (row.call == "decode") {
    EXPECT_EQ(shape.query_len, 0) << "a decode has one token per sequence: " << row.text;
    return decode_form(astr::kernels::plan_paged_decode(shape, device, {}));
  }
  if (row.call == "verify") {
    EXPECT_GT(shape.query_len, 0) << "a verify row names its Q: " << row.text;
    if (astr::kernels::prefill_runs_as_verify(shape.query_len, {}, row.batch_invariant))
      return decode_form(astr::kernels::plan_paged_decode(shape, device, {}));
  } else {
    EXPECT_EQ(row.call, "prefill") << row.text;
  }
  std::optional<int64_t> scratch;
  if (fp8) {
    const bool past_limit = row.cache.find("past the scratch limit") != std::string::npos;
    scratch = past_limit ? kFp8ScratchLimitBytes + 1 : kFp8ScratchLimitBytes;
  }
  const PrefillPlan plan = astr::kernels::plan_paged_prefill(head_dims.qk, device, tuning, scratch,
                                                             {}, row.batch_invariant, head_dims.v);
  if (!plan.error.empty()) return plan.error;
  return astr::kernels::describe_plan(plan, fp8);
}

TEST(KernelTable, EveryRowIsWhatThePlanPicks) {
  for (bool batch_invariant : {false, true}) {
    const std::vector<Row> rows = table_rows(batch_invariant);
    ASSERT_GE(rows.size(), 5u) << "no table between "
                               << (batch_invariant ? kInvariantBegin : kBegin) << " and its end in "
                               << ASTR_CSRC_README;
    for (const Row& row : rows) {
      for (const std::string& head_dim : split(row.head_dims, ',')) {
        EXPECT_EQ(planned_form(row, parse_head_dims(head_dim)), row.form)
            << "head dim " << head_dim << " of the row\n  " << row.text;
      }
    }
  }
}

// The opt-in forms (a kernel tuning selects them, the automatic choice never does until a GPU
// has measured them): each row's tuning through the plan. Prefill rows only.
TEST(KernelTable, EveryOptInRowIsWhatItsTuningPicks) {
  const std::vector<Row> rows = rows_between(kOptInBegin, kOptInEnd, false);
  ASSERT_GE(rows.size(), 3u) << "no table between " << kOptInBegin << " and its end in "
                             << ASTR_CSRC_README;
  for (const Row& row : rows) {
    EXPECT_EQ(row.call, "prefill") << row.text;
    KernelTuning tuning;
    ASSERT_EQ(astr::kernels::parse_kernel_tuning(row.batch, &tuning), "") << row.text;
    Row call = row;
    call.batch.clear();  // a prefill row: "any" batch
    for (const std::string& head_dim : split(row.head_dims, ',')) {
      EXPECT_EQ(planned_form(call, parse_head_dims(head_dim), tuning), row.form)
          << "head dim " << head_dim << " of the row\n  " << row.text;
      // Without its tuning the row's call runs another form.
      EXPECT_NE(planned_form(call, parse_head_dims(head_dim)).rfind("persistent", 0), 0u)
          << row.text;
    }
  }
}

// Every head dim the kernels are built for appears in both tables, for prefill, decode, verify and
// top-k (a row without top-k kernels as the plan's refusal).
TEST(KernelTable, CoversEveryHeadDimAndCallKind) {
  for (bool batch_invariant : {false, true}) {
    const std::vector<Row> rows = table_rows(batch_invariant);
    for (const auto& forms : astr::kernels::kPagedHeadDims) {
      for (const std::string call : {"prefill", "decode", "verify", "topk"}) {
        bool found = false;
        for (const Row& row : rows) {
          for (const std::string& head_dim : split(row.head_dims, ',')) {
            const HeadDims dims = parse_head_dims(head_dim);
            found |= row.call == call && dims.qk == forms.head_dim && dims.v == forms.head_dim_v;
          }
        }
        EXPECT_TRUE(found) << call << " at head dims " << forms.head_dim << "/" << forms.head_dim_v
                           << " has no row"
                           << (batch_invariant ? " in the batch-invariant table" : "");
      }
    }
  }
}

}  // namespace
