// Latent attention (astr::mla_attention) in the torch-free tiers: the capability rules of a
// latent call (cuda takes the kernel's dims, dtypes and pages; flash none; torch_native any), the
// memo key that keeps latent and plain calls apart, and the cuda kernel's plan.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../../csrc/kernels/mla/plan.h"
#include "capability.h"
#include "device_facts.h"
#include "resolver.h"

namespace astr::dispatch {
namespace {

std::array<BackendStatus, kNumBackends> all_available() {
  return {BackendStatus{true, "", 0}, BackendStatus{true, "", 3}, BackendStatus{true, "", 0}};
}

// A bf16 DeepSeek decode on an H100: 128 heads over latent 512 + rope 64, pages of 64.
CallDescription latent_decode() {
  CallDescription call;
  call.latent = true;
  call.dtype = ScalarType::kBFloat16;
  call.device = DeviceKind::kCUDA;
  call.arch = 90;
  call.q_rank = 3;
  call.head_dim = 576;
  call.head_dim_v = 512;
  call.num_q_heads = 128;
  call.num_kv_heads = 1;
  call.has_kv_cache = true;
  call.page_size = 64;
  call.mode = Mode::kDecode;
  call.kv_dtype = ScalarType::kBFloat16;
  return call;
}

bool mentions(const std::vector<std::string>& reasons, const std::string& text) {
  for (const auto& reason : reasons) {
    if (reason.find(text) != std::string::npos) return true;
  }
  return false;
}

std::vector<std::string> cuda_reasons(const CallDescription& call) {
  return rejection_reasons(Backend::kCuda, call, {true, "", 0}, Checks::kAll);
}

TEST(LatentCapability, CudaRunsADeepSeekDecodeAndFlashNever) {
  const Decision decision = resolve_backend(latent_decode(), {}, all_available());
  ASSERT_TRUE(decision.chosen.has_value());
  EXPECT_EQ(*decision.chosen, Backend::kCuda);
  const auto& flash = decision.reasons[static_cast<int>(Backend::kFlash)];
  ASSERT_EQ(flash.size(), 1u);
  EXPECT_EQ(flash[0], "latent attention (mla_attention) not supported by the flash backend");
  EXPECT_TRUE(decision.reasons[static_cast<int>(Backend::kTorchNative)].empty());
}

TEST(LatentCapability, CudaTakesTheKernelsDimsDtypesAndPages) {
  for (int page_size : {1, 16, 64, 256, 48}) {
    CallDescription call = latent_decode();
    call.page_size = page_size;
    EXPECT_TRUE(cuda_reasons(call).empty()) << page_size;
  }
  CallDescription call = latent_decode();
  call.page_size = 512;
  EXPECT_TRUE(mentions(cuda_reasons(call), "page_size 512 not supported (supported: 1 to 256)"));
  call = latent_decode();
  call.head_dim = 256 + 32;
  call.head_dim_v = 256;
  EXPECT_TRUE(mentions(cuda_reasons(call),
                       "latent dim 256 and rope dim 32 not supported (supported: 512 and 64)"));
  call = latent_decode();
  call.dtype = call.kv_dtype = ScalarType::kFloat32;
  EXPECT_TRUE(mentions(cuda_reasons(call), "dtype float32 not supported"));
  call = latent_decode();
  call.arch = 75;
  EXPECT_TRUE(mentions(cuda_reasons(call), "needs sm_80 or newer"));
  call = latent_decode();
  call.needs_grad = true;
  EXPECT_TRUE(mentions(cuda_reasons(call), "has no backward"));
  call = latent_decode();
  call.kv_dtype = ScalarType::kFloat8E4M3;
  call.kv_scales = true;
  EXPECT_TRUE(cuda_reasons(call).empty());
  call.num_q_heads = 24;  // a partial head group of the kernel: fine
  EXPECT_TRUE(cuda_reasons(call).empty());
}

TEST(LatentCapability, TorchNativeRunsAnyLatentShapeOnAnyDevice) {
  CallDescription call = latent_decode();
  call.device = DeviceKind::kCPU;
  call.arch = 0;
  call.dtype = call.kv_dtype = ScalarType::kFloat32;
  call.head_dim = 40;
  call.head_dim_v = 32;
  const Decision decision = resolve_backend(call, {}, all_available());
  ASSERT_TRUE(decision.chosen.has_value());
  EXPECT_EQ(*decision.chosen, Backend::kTorchNative);
}

TEST(LatentCapability, TheMemoKeepsLatentAndPlainCallsApart) {
  // A plain paged call of the same sizes is one the cuda paged kernels refuse (head dim 576);
  // the memoised decision of the latent call must not answer it.
  CallDescription latent = latent_decode();
  CallDescription plain = latent;
  plain.latent = false;
  BackendStatusTable& table = BackendStatusTable::instance();
  table.set(Backend::kCuda, {true, "", 0});
  const Selection selection{SelectionSource::kArgument, "cuda"};
  EXPECT_TRUE(resolve_backend_cached(latent, selection, table).chosen.has_value());
  EXPECT_FALSE(resolve_backend_cached(plain, selection, table).chosen.has_value());
}

}  // namespace
}  // namespace astr::dispatch

namespace astr::kernels {
namespace {

using testing::sm80_facts;
using testing::sm90_facts;

MlaCallShape decode_shape(int64_t num_seqs, int64_t num_heads, int64_t max_seq_len) {
  MlaCallShape shape;
  shape.num_seqs = num_seqs;
  shape.num_heads = num_heads;
  shape.max_seq_len = max_seq_len;
  return shape;
}

MlaCallShape prefill_shape(int64_t num_seqs, int64_t max_query_len, int64_t num_heads,
                           int64_t max_seq_len) {
  MlaCallShape shape = decode_shape(num_seqs, num_heads, max_seq_len);
  shape.decode = false;
  shape.max_query_len = max_query_len;
  return shape;
}

TEST(MlaPlan, Sm90RunsTheTensorCoreKernelOverRowTilesOfTokensTimesHeads) {
  const MlaPlan decode = plan_mla_attention(decode_shape(200, 128, 32768), sm90_facts());
  EXPECT_TRUE(decode.error.empty());
  EXPECT_EQ(decode.kernel, MlaKernel::kTensorCore);
  EXPECT_EQ(decode.row_tiles, 2);   // 128 heads of one token
  EXPECT_EQ(decode.num_splits, 1);  // 400 blocks fill 132 SMs
  EXPECT_EQ(decode.threads, 256);
  EXPECT_FALSE(decode.poison_unplaced_rows);
  EXPECT_EQ(describe_plan(decode), "tensor_core");
  // The query tile, two tiles of 32 positions (16-bit rows of 576 + 8), P (rows of 32 + 8) and
  // two floats a row.
  EXPECT_EQ(decode.smem_bytes, (64 + 2 * 32) * 584 * 2 + 64 * 40 * 2 + 2 * 64 * 4);
  // s_q = 2 (a prefill of 2 new tokens): both tokens' heads share the tiles.
  EXPECT_EQ(plan_mla_attention(prefill_shape(200, 2, 128, 32768), sm90_facts()).row_tiles, 4);
  EXPECT_EQ(plan_mla_attention(prefill_shape(200, 2, 16, 32768), sm90_facts()).row_tiles, 1);
  // 24 heads: tiles cut across tokens (40 x 24 = 960 rows).
  const MlaPlan prefill = plan_mla_attention(prefill_shape(3, 40, 24, 4096), sm90_facts());
  EXPECT_EQ(prefill.kernel, MlaKernel::kTensorCore);
  EXPECT_EQ(prefill.row_tiles, 15);
  EXPECT_TRUE(prefill.poison_unplaced_rows);
}

TEST(MlaPlan, TheFp8LatentAddsItsStagingTiles) {
  MlaCallShape shape = decode_shape(64, 128, 4096);
  shape.fp8 = true;
  const MlaPlan plan = plan_mla_attention(shape, sm90_facts());
  EXPECT_EQ(plan.kernel, MlaKernel::kTensorCore);
  EXPECT_EQ(plan.smem_bytes, (64 + 2 * 32) * 584 * 2 + 64 * 40 * 2 + 2 * 64 * 4 + 2 * 32 * 512);
  EXPECT_LE(plan.smem_bytes, sm90_facts().max_smem_per_block);
}

TEST(MlaPlan, SplitsFillTheSmsFromShapesAlone) {
  // One sequence of 16 heads: one row tile; splits up to the cap, each >= 256 positions of the
  // block table's capacity.
  EXPECT_EQ(plan_mla_attention(decode_shape(1, 16, 32768), sm90_facts()).num_splits, 64);
  EXPECT_EQ(plan_mla_attention(decode_shape(1, 16, 4096), sm90_facts()).num_splits, 16);
  EXPECT_EQ(plan_mla_attention(decode_shape(1, 16, 300), sm90_facts()).num_splits, 2);
  EXPECT_EQ(plan_mla_attention(decode_shape(1, 16, 200), sm90_facts()).num_splits, 1);
  // 16 sequences of 128 heads: 32 blocks, 5 splits make 160 >= 132.
  const MlaPlan plan = plan_mla_attention(decode_shape(16, 128, 32768), sm90_facts());
  EXPECT_EQ(plan.num_splits, 5);
  EXPECT_EQ(describe_plan(plan), "tensor_core/split x5");
  EXPECT_EQ(plan_mla_attention(decode_shape(64, 128, 32768), sm90_facts()).num_splits, 2);
  EXPECT_EQ(plan_mla_attention(decode_shape(128, 128, 32768), sm90_facts()).num_splits, 1);
}

TEST(MlaPlan, MoreTokensThanTheGridPlacesTakeOneSplitAndNoWorkspace) {
  // One sequence of at most 1 new token, 16 heads: the rule's 64 splits.
  MlaCallShape shape = prefill_shape(1, 1, 16, 32768);
  shape.num_tokens = 1;
  EXPECT_EQ(plan_mla_attention(shape, sm90_facts()).num_splits, 64);
  // 100000 tokens (bad metadata: the rows past max_query_len are poisoned): a workspace of
  // 64 x 100000 x 16 rows of 2 KiB would be 200 GiB.
  shape.num_tokens = 100000;
  EXPECT_EQ(plan_mla_attention(shape, sm90_facts()).num_splits, 1);
  KernelTuning tuning;
  ASSERT_EQ(parse_kernel_tuning("mla_splits=7", &tuning), "");
  EXPECT_EQ(plan_mla_attention(shape, sm90_facts(), tuning).num_splits, 1);
}

TEST(MlaPlan, TheSimpleKernelIsTheFallbackBelowSm90AndForGridsTooTall) {
  const MlaPlan decode = plan_mla_attention(decode_shape(64, 128, 4096), sm80_facts());
  EXPECT_TRUE(decode.error.empty());
  EXPECT_EQ(decode.kernel, MlaKernel::kSimple);
  EXPECT_EQ(describe_plan(decode), "simple");
  EXPECT_EQ(decode.grid_rows, 64);
  EXPECT_EQ(decode.grid_heads, 8);
  EXPECT_FALSE(decode.poison_unplaced_rows);
  const MlaPlan prefill = plan_mla_attention(prefill_shape(3, 40, 24, 4096), sm80_facts());
  EXPECT_EQ(prefill.grid_rows, 120);
  EXPECT_EQ(prefill.grid_heads, 2);  // 16 + a partial group of 8
  EXPECT_TRUE(prefill.poison_unplaced_rows);
  // The query rows and one tile of positions as float32, under every sm_80+ GPU's limit.
  EXPECT_EQ(decode.smem_bytes, (16 + 16) * 577 * 4);
  EXPECT_LE(decode.smem_bytes, 99 * 1024);
  // sm_89 (99 KB a block) cannot hold the tensor-core tiles.
  DeviceFacts ada = sm90_facts();
  ada.arch = 89;
  ada.max_smem_per_block = 101376;
  EXPECT_EQ(plan_mla_attention(decode_shape(64, 128, 4096), ada).kernel, MlaKernel::kSimple);
  // More than 65535 row tiles (a prefill of 40000 tokens x 128 heads) do not fit grid y.
  EXPECT_EQ(plan_mla_attention(prefill_shape(1, 40000, 128, 65536), sm90_facts()).kernel,
            MlaKernel::kSimple);
}

TEST(MlaPlan, TheTuningForcesTheSimpleKernelOrASplitCount) {
  KernelTuning tuning;
  ASSERT_EQ(parse_kernel_tuning("mla_kernel=simple", &tuning), "");
  EXPECT_EQ(plan_mla_attention(decode_shape(64, 128, 4096), sm90_facts(), tuning).kernel,
            MlaKernel::kSimple);
  ASSERT_EQ(parse_kernel_tuning("mla_kernel=tensor_core,mla_splits=7", &tuning), "");
  const MlaPlan plan = plan_mla_attention(decode_shape(200, 128, 4096), sm90_facts(), tuning);
  EXPECT_EQ(plan.kernel, MlaKernel::kTensorCore);
  EXPECT_EQ(plan.num_splits, 7);
  EXPECT_EQ(describe_plan(plan), "tensor_core/split x7");
  // A preference: where the tensor-core kernel cannot run, the simple one does.
  EXPECT_EQ(plan_mla_attention(decode_shape(64, 128, 4096), sm80_facts(), tuning).kernel,
            MlaKernel::kSimple);
  for (const char* bad : {"mla_kernel=fast", "mla_splits=0", "mla_splits=65"}) {
    KernelTuning unchanged = tuning;
    EXPECT_NE(parse_kernel_tuning(bad, &unchanged), "") << bad;
    EXPECT_EQ(unchanged.mla_splits, 7) << bad;
  }
}

// csrc/README.md's latent kernel table, row by row through the plan: "| GPU | heads | call |
// cache | batch | kernel |", call "decode" or "prefill Q=N", batch "B=N L=N".
std::vector<std::vector<std::string>> latent_table_rows() {
  std::ifstream file(ASTR_CSRC_README);
  std::vector<std::vector<std::string>> rows;
  std::string line;
  bool inside = false;
  while (std::getline(file, line)) {
    if (line == "<!-- latent kernel table begin -->") inside = true;
    if (line == "<!-- latent kernel table end -->") break;
    if (!inside || line.rfind("| ", 0) != 0 || line.find("---") != std::string::npos) continue;
    std::vector<std::string> cells;
    std::stringstream cells_text(line.substr(1));
    std::string cell;
    while (std::getline(cells_text, cell, '|')) {
      const size_t first = cell.find_first_not_of(" `"), last = cell.find_last_not_of(" `");
      cells.push_back(first == std::string::npos ? "" : cell.substr(first, last - first + 1));
    }
    if (cells.size() >= 6 && cells[0] != "GPU") rows.push_back(cells);
  }
  return rows;
}

int64_t value_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key + "=");
  return at == std::string::npos ? -1 : std::stoll(text.substr(at + key.size() + 1));
}

TEST(MlaPlan, TheReadmesLatentKernelTableIsWhatThePlanPicks) {
  const auto rows = latent_table_rows();
  ASSERT_GE(rows.size(), 5u) << "no latent kernel table in " << ASTR_CSRC_README;
  for (const auto& row : rows) {
    const DeviceFacts device = row[0].rfind("H100", 0) == 0 ? sm90_facts() : sm80_facts();
    MlaCallShape shape =
        decode_shape(value_after(row[4], "B"), std::stoll(row[1]), value_after(row[4], "L"));
    if (row[2] != "decode") {
      shape.decode = false;
      shape.max_query_len = value_after(row[2], "Q");
    }
    shape.fp8 = row[3] == "FP8";
    const MlaPlan plan = plan_mla_attention(shape, device);
    EXPECT_TRUE(plan.error.empty()) << plan.error;
    EXPECT_EQ(describe_plan(plan), row[5])
        << row[0] << " " << row[1] << " " << row[2] << " " << row[3] << " " << row[4];
  }
}

TEST(MlaPlan, RefusesGridsItCannotLaunch) {
  EXPECT_FALSE(
      plan_mla_attention(prefill_shape(1 << 20, 1 << 12, 16, 4096), sm80_facts()).error.empty());
  EXPECT_FALSE(plan_mla_attention(prefill_shape(2, 0, 16, 4096), sm90_facts()).error.empty());
}

}  // namespace
}  // namespace astr::kernels
